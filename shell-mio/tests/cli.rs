//! The command line as an operator meets it. (These tests also make `cargo test
//! --workspace` build the `kvwarden` binary that the end-to-end tests in `tests/` run.)

use std::process::Command;

fn kvwarden(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvwarden"))
        .args(args)
        .output()
        .expect("running kvwarden")
}

#[test]
fn serve_help_teaches_the_flags() {
    let output = kvwarden(&["serve", "--help"]);
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for flag in [
        "--worker-reap-timeout-seconds",
        "--worker-registration-grace-seconds",
        "--resolution-seconds",
        "--socket",
        "--socket-mode",
        "--tcp",
        "--tcp-token-file",
        "--tenant",
        "--http",
        "--l1-bytes",
        "--slot-bytes",
        "--max-frame-bytes",
        "--max-connections",
        "--free-watchdog-seconds",
        "--allow-short-timeouts",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
}

#[test]
fn reap_timeout_below_the_floor_exits_non_zero_with_the_core_message() {
    let output = kvwarden(&[
        "serve",
        "--worker-reap-timeout-seconds",
        "10",
        "--http",
        "off",
    ]);
    assert!(!output.status.success());
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(message.contains("reap timeout"), "{message}");
    assert!(message.contains("10.0"), "{message}");
    assert!(message.contains("heartbeat interval"), "{message}");
}

#[test]
fn grace_below_timeout_and_nan_are_refused() {
    let output = kvwarden(&[
        "serve",
        "--worker-reap-timeout-seconds",
        "120",
        "--worker-registration-grace-seconds",
        "60",
    ]);
    assert!(!output.status.success());
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(message.contains("registration grace"), "{message}");
    let output = kvwarden(&["serve", "--worker-reap-timeout-seconds", "NaN"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("reap timeout"));
}

#[test]
fn status_without_a_server_says_how_to_start_one() {
    let output = kvwarden(&["status", "--socket", "/nonexistent/kvwarden.sock"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("kvwarden serve"));
}
