//! A worker that forks, for the end-to-end test that a forked child does not keep its
//! parent "alive" (row 1): it connects to the socket named by its only argument (the
//! client sends its pidfd), registers one memfd buffer, opens a pidfd of itself that it
//! keeps, then forks. The child inherits the socket, the memfd and that pidfd and does
//! nothing, forever. The parent prints `instance_id=<n> child_pid=<pid>
//! exit_proof=<label>` and sleeps until it is killed.

use kvwarden::client::{Client, ClientConfig, Endpoint, MemfdBuffer};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

fn main() -> ExitCode {
    let Some(socket) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: kvwarden-fork-worker <socket>");
        return ExitCode::from(2);
    };
    let client = match Client::connect(ClientConfig::new(Endpoint::Unix(socket))) {
        Ok(client) => client,
        Err(error) => {
            eprintln!("kvwarden-fork-worker: {error}");
            return ExitCode::from(1);
        }
    };
    let registered = MemfdBuffer::new(4096)
        .and_then(|buffer| client.register(vec![Arc::new(buffer)], "fork-test", 1));
    if let Err(error) = registered {
        eprintln!("kvwarden-fork-worker: registering failed: {error}");
        return ExitCode::from(1);
    }
    let own_pidfd = rustix::process::pidfd_open(
        rustix::process::getpid(),
        rustix::process::PidfdFlags::empty(),
    );
    let _ = std::io::stdout().flush();
    // SAFETY: the child only calls `pause` (async-signal-safe) forever: it touches no
    // lock or allocation another thread of the parent might have held at the fork.
    let child = unsafe { libc::fork() };
    if child == 0 {
        loop {
            // SAFETY: pause has no preconditions.
            unsafe { libc::pause() };
        }
    }
    if child < 0 {
        eprintln!(
            "kvwarden-fork-worker: fork failed: {}",
            std::io::Error::last_os_error()
        );
        return ExitCode::from(1);
    }
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(
        stdout,
        "instance_id={} child_pid={child} exit_proof={}",
        client.instance_id(),
        client.exit_proof().as_deref().unwrap_or("unknown")
    );
    let _ = stdout.flush();
    drop(stdout);
    let _keep = (own_pidfd, client);
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
