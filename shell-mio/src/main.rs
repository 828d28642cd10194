fn main() {
    eprintln!("kvwarden: the server is not built yet");
    std::process::exit(2);
}
