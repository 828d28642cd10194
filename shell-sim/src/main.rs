//! `kvwarden-sim`: see `docs/simulator.md`.

fn main() {
    std::process::exit(kvwarden_sim::cli::main());
}
