//! `kvwarden`: see `kvwarden --help`.

fn main() -> std::process::ExitCode {
    kvwarden::cli::main()
}
