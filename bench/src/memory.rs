//! S7: the server's memory with 10,000 registered instances, L1 excluded (target:
//! ≤ 64 MiB RSS).
//!
//! L1 is excluded by construction: the started server gets a one-slot L1
//! (`--l1-bytes 2M --slot-bytes 2M`) that this benchmark never stores into, so none of
//! its pages are resident; `RssShmem` is printed to show it. Each instance registers
//! one small memfd buffer (the same memfd every time), so the server holds an fd, a
//! mapping and a context per instance, as with real workers.

use super::process::MemoryUse;
use super::raw::instance_ids;
use super::target::{Target, TargetArgs};
use super::{BenchError, figure, progress};
use rustix::fd::AsFd;

/// Flags of `kvwarden bench memory`.
#[derive(Clone, Debug, clap::Args)]
pub struct MemoryArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Instances registered.
    #[arg(long, default_value_t = 10_000, value_name = "N")]
    instances: usize,
    /// Bytes of the memfd buffer each instance registers (0: none).
    #[arg(long, default_value = "4K", value_name = "BYTES", value_parser = kvwarden_client::parse_bytes)]
    buffer_bytes: u64,
}

/// Runs S7 and prints its figures.
pub fn run(args: &MemoryArgs) -> Result<(), BenchError> {
    let count = args.instances.max(1);
    super::print_machine();
    let target = Target::start(
        &args.target,
        "bench-memory",
        &["--l1-bytes", "2M", "--slot-bytes", "2M"],
    )?;
    let mut control = target.connect()?;
    let idle = MemoryUse::of(target.pid)?;
    progress(&format!("server idle: {}", idle.describe()));
    let memfd = if args.buffer_bytes > 0 {
        Some(
            crate::memfd::create("kvwarden-bench-memory", args.buffer_bytes)
                .map_err(BenchError::io("creating a memfd"))?,
        )
    } else {
        None
    };
    let ids = instance_ids(count);
    let buffer = memfd.as_ref().map(|fd| (fd.as_fd(), args.buffer_bytes));
    control.register_many(&ids, buffer)?;
    // Every register was answered: every build has finished.
    let held = MemoryUse::of(target.pid)?;
    let status = control.status()?;
    let tracked = status.worker_liveness.tracked_instances;
    progress(&format!(
        "server with {tracked} tracked instances: {}",
        held.describe()
    ));
    control.unregister_many(&ids)?;
    let buffers = if args.buffer_bytes > 0 {
        format!("one {} KiB memfd buffer each", args.buffer_bytes >> 10)
    } else {
        "no buffers".into()
    };
    let l1 = if target.is_spawned() {
        "L1 excluded: a 2 MiB one-slot L1 never stored into"
    } else {
        "the running server's L1 as configured (untouched pages are not resident)"
    };
    figure(
        "S7",
        "server_rss_idle",
        format!("{:.1}", idle.rss_mib()),
        "MiB",
        &format!("VmRSS before any registration; {}", idle.describe()),
    );
    figure(
        "S7",
        "server_rss_with_instances",
        format!("{:.1}", held.rss_mib()),
        "MiB",
        &format!(
            "VmRSS with {tracked} registered instances ({buffers}); {}; {l1}; target <= 64 MiB",
            held.describe()
        ),
    );
    let per_instance =
        (held.rss_kib.saturating_sub(idle.rss_kib) * 1024) as f64 / count.max(1) as f64;
    figure(
        "S7",
        "rss_per_instance",
        format!("{per_instance:.0}"),
        "bytes",
        "(VmRSS with instances - idle) / instances",
    );
    target.check_no_ping_answered_false()?;
    Ok(())
}
