//! `kvwarden demo` end to end: it runs, exits 0, and its timeline tells the story
//! (SIGKILL → freed by the process-exit proof, SIGSTOP → reaped, SIGCONT → exactly one
//! fresh context) in a screenful, each event once, and it leaves no process behind.

use kvwarden_tests::kvwarden_bin;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The demo takes a few seconds; a loaded CI machine gets far more.
const BOUND: Duration = Duration::from_secs(180);
/// A newcomer reads the whole demo on one screen.
const MAX_LINES: usize = 30;

#[test]
fn demo_kills_freezes_and_thaws_and_prints_its_timeline() {
    let mut child = Command::new(kvwarden_bin())
        // A longer timeout than the demo's 3 s: a busy CI machine must not starve the
        // untouched worker's heartbeat for that long.
        .args(["demo", "--worker-reap-timeout-seconds", "6"])
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
    // Timeline lines read `[<elapsed> s] <event>`.
    let timeline: Vec<&str> = stdout
        .lines()
        .filter(|line| line.starts_with('[') && line.contains(" s] "))
        .collect();
    assert!(!timeline.is_empty(), "no timeline in:\n{stdout}");
    let timeline = timeline.join("\n");
    for expected in [
        "server up",
        "worker A",
        "traffic:",
        "SIGKILL worker A",
        "worker A freed",
        "its process exited",
        "SIGSTOP worker B",
        "worker B reaped",
        "SIGCONT worker B",
        "worker B re-registered",
        "exactly one fresh context built (outcome=created)",
        "server stopped (SIGTERM)",
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
    assert!(
        stdout.lines().count() <= MAX_LINES,
        "the demo printed {} lines, more than {MAX_LINES}:\n{stdout}",
        stdout.lines().count()
    );
    // Each event once: no line of the timeline repeats (the elapsed time aside).
    let mut events = std::collections::BTreeSet::new();
    for line in timeline.lines() {
        let event = line.split_once(" s] ").map_or(line, |(_, event)| event);
        assert!(
            events.insert(event),
            "event printed twice: {event:?}\n{stdout}"
        );
    }
    // One outcome per line: a line never says both created and refreshed.
    for line in stdout.lines() {
        assert!(
            line.matches("outcome=").count() <= 1,
            "a line with more than one outcome: {line:?}"
        );
    }
    // The plain word comes before the jargon on each key line.
    for (word, jargon) in [("freed", "pidfd"), ("reaped", "reap timeout")] {
        let line = timeline
            .lines()
            .find(|l| l.contains(word) && l.contains(jargon))
            .unwrap_or_else(|| panic!("no line with {word:?} and {jargon:?}:\n{timeline}"));
        assert!(
            line.find(word) < line.find(jargon),
            "{jargon:?} comes before {word:?}: {line:?}"
        );
    }
}
