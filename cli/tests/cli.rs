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
fn a_negative_value_after_a_space_gets_the_flags_range() {
    for args in [
        &["serve", "--worker-reap-timeout-seconds", "-1"][..],
        &["serve", "--worker-reap-timeout-seconds=-1"][..],
    ] {
        let output = kvwarden(args);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let message = String::from_utf8_lossy(&output.stderr);
        assert!(
            message.contains("use 0 to disable reaping, or at least 30.0 s"),
            "{args:?}: {message}"
        );
    }
    let output = kvwarden(&["demo", "--worker-reap-timeout-seconds", "-1"]);
    assert_eq!(output.status.code(), Some(2));
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(message.contains("use 0.5 to 30 seconds"), "{message}");
}

#[test]
fn serve_and_demo_name_the_reap_timeout_alike_and_take_the_old_spelling() {
    for command in ["serve", "demo"] {
        let output = kvwarden(&[command, "--help"]);
        let help = String::from_utf8_lossy(&output.stdout);
        assert!(help.contains("--worker-reap-timeout-seconds"), "{help}");
        // The old spelling is a hidden alias: taken, never taught.
        assert!(!help.contains(" --reap-timeout-seconds"), "{help}");
    }
    // Taken by both (a refused value shows the flag was parsed as the reap timeout).
    let output = kvwarden(&["serve", "--reap-timeout-seconds", "10", "--http", "off"]);
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(message.contains("invalid reap timeout 10.0"), "{message}");
    let output = kvwarden(&["demo", "--reap-timeout-seconds", "99"]);
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(
        message.contains("invalid --worker-reap-timeout-seconds 99"),
        "{message}"
    );
}

#[test]
fn status_call_and_worker_without_a_server_say_how_to_start_one() {
    for args in [
        &["status"][..],
        &["call", "ping"][..],
        &["worker", "--buffer-bytes", "64K"][..],
    ] {
        let mut full = args.to_vec();
        full.extend(["--socket", "/nonexistent/kvwarden.sock"]);
        let output = kvwarden(&full);
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        let message = String::from_utf8_lossy(&output.stderr);
        assert!(
            message.contains(
                "no kvwarden server at unix:/nonexistent/kvwarden.sock (No such file or directory"
            ) && message.contains("is the server running? Start it with `kvwarden serve`"),
            "{args:?}: {message}"
        );
    }
}

/// Exit 2 with one line naming the flag, the value and the fix, for each refusal.
#[test]
fn bad_values_are_refused_naming_the_flag_and_the_form() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let socket = dir.path().join("s.sock");
    let socket = socket.to_str().expect("a UTF-8 path");
    for (args, says) in [
        (
            vec!["--pool-threads", "0"],
            "--pool-threads 0: use 1 to 256",
        ),
        (vec!["--l2", "foo"], "redis://HOST:PORT"),
        (vec!["--http", "no-such-host.invalid:80"], "invalid --http"),
        (vec!["--tcp", "127.0.0.1:0"], "--tcp needs --tcp-token-file"),
    ] {
        let mut full = vec!["serve", "--socket", socket];
        full.extend(&args);
        let output = kvwarden(&full);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    // A socket path longer than a Unix socket address holds is named as such.
    let long = format!("/tmp/{}/s.sock", "d".repeat(120));
    let output = kvwarden(&["serve", "--socket", &long, "--http", "off"]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("at most 107"), "{stderr}");
    assert!(!stderr.contains("permissions"), "{stderr}");
}

/// `kvwarden call` exits 3 on an error reply (printing it), 0 on an ok one; host names
/// are taken where an address is (`--http localhost:0`); `HEAD /healthz` is answered.
#[test]
fn call_exits_non_zero_on_an_error_reply_and_http_takes_a_host_name() {
    use std::io::{BufRead, BufReader, Read, Write};
    let dir = tempfile::tempdir().expect("a temp dir");
    let socket = dir.path().join("s.sock");
    let mut server = Command::new(env!("CARGO_BIN_EXE_kvwarden"))
        .args(["serve", "--socket"])
        .arg(&socket)
        .args([
            "--http",
            "localhost:0",
            "--l1-bytes",
            "4M",
            "--slot-bytes",
            "64K",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starting kvwarden serve");
    let mut http = None;
    for line in BufReader::new(server.stdout.take().expect("stdout")).lines() {
        let line = line.expect("a line");
        if let Some(address) = line.strip_prefix("http=") {
            http = Some(address.to_string());
        }
        if line == "ready" {
            break;
        }
    }
    let http = http.expect("the server says http=ADDR");
    assert!(
        http.starts_with("127.0.0.1:") || http.starts_with("[::1]:"),
        "{http}"
    );
    let socket = socket.to_str().expect("a UTF-8 path");
    let ok = kvwarden(&["call", "--socket", socket, "ping", "[null]"]);
    assert_eq!(ok.status.code(), Some(0));
    // No args at all: the arguments are blamed (the form named), not the versions.
    let refused = kvwarden(&["call", "--socket", socket, "ping"]);
    assert_eq!(refused.status.code(), Some(3));
    let reply = String::from_utf8_lossy(&refused.stdout);
    assert!(reply.contains("\"code\":\"bad_args\""), "{reply}");
    assert!(reply.contains("send the arguments in that form"), "{reply}");
    let hint = String::from_utf8_lossy(&refused.stderr);
    assert!(
        hint.contains("`ping` refused its args []: give them as one JSON array"),
        "{hint}"
    );
    let mut stream = std::net::TcpStream::connect(&http).expect("connecting to HTTP");
    stream
        .write_all(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("sending HEAD");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("reading");
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    assert!(
        response.ends_with("\r\n\r\n"),
        "no body for HEAD: {response:?}"
    );
    let _ = server.kill();
    let _ = server.wait();
}
