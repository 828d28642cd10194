//! `kvwarden demo` end to end: it runs, exits 0, and its timeline tells the story
//! (SIGKILL → freed by the process-exit proof, SIGSTOP → reaped, SIGCONT → exactly one
//! fresh context), and it leaves no process behind.

use kvwarden_tests::kvwarden_bin;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The demo takes a few seconds; a loaded CI machine gets far more.
const BOUND: Duration = Duration::from_secs(180);

#[test]
fn demo_kills_freezes_and_thaws_and_prints_its_timeline() {
    let mut child = Command::new(kvwarden_bin())
        // A longer timeout than the demo's 3 s: a busy CI machine must not starve the
        // untouched worker's heartbeat for that long.
        .args(["demo", "--reap-timeout-seconds", "6"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning kvwarden demo");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the demo") {
            break status;
        }
        if start.elapsed() > BOUND {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvwarden demo ran longer than {BOUND:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = out.join().expect("stdout reader");
    let stderr = err.join().expect("stderr reader");
    assert!(
        status.success(),
        "kvwarden demo exited with {status}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let timeline = stdout
        .split("\nTimeline:\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no timeline in:\n{stdout}"));
    for expected in [
        "server up",
        "worker A",
        "traffic:",
        "SIGKILL worker A",
        "freed",
        "by the process-exit proof",
        "SIGSTOP worker B",
        "worker B reaped",
        "SIGCONT worker B",
        "re-registered the same instance",
        "outcome=created, exactly one context built",
        "server stopped by SIGTERM",
    ] {
        assert!(
            timeline.contains(expected),
            "the timeline lacks {expected:?}:\n{timeline}"
        );
    }
    assert!(
        stdout.contains("DEMO SETTINGS"),
        "the short timeouts are not labelled:\n{stdout}"
    );
    assert!(
        stdout.contains("Final status:") && stdout.contains("INSTANCE"),
        "no final status table:\n{stdout}"
    );
    // Every process it started (server and workers, `(pid N)`) is gone.
    let pids: std::collections::BTreeSet<u32> = timeline
        .split("(pid ")
        .skip(1)
        .filter_map(|rest| rest.split(')').next()?.parse().ok())
        .collect();
    assert_eq!(pids.len(), 4, "a server and three workers: {timeline}");
    for pid in pids {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(
            state.is_empty() || !state.contains("kvwarden"),
            "process {pid} of the demo outlived it: {state}"
        );
    }
    // Timeline lines read `<elapsed> s  <event>`.
    let first = timeline.lines().next().unwrap_or_default().trim();
    let elapsed = first.split(" s  ").next().unwrap_or_default();
    assert!(
        elapsed.parse::<f64>().is_ok(),
        "a timeline line without its elapsed time: {first:?}"
    );
}
