fn main() {
    eprintln!("kvwarden-sim: the simulator is not built yet");
    std::process::exit(2);
}
