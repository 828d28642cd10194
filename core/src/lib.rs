//! The deterministic sans-IO core of kvwarden: every decision the server makes, from
//! which workers are alive and when a dead one's state must be freed to who may act on
//! an instance and whose cache is whose.
//!
//! The core never reads a clock, never sleeps, never does I/O and has no randomness on
//! any path that decides an outcome. Every input carries `now`; every consequence comes
//! out as data: an [`Effect`] of the registry, a [`node::Output`] of the node. The
//! production shell (`kvwarden`) and the simulator (`kvwarden-sim`) drive the same core.
//!
//! - [`node::Node`]: the server's request logic as one state machine
//!   (`handle_input(now, …)`, `handle_timeout`, `poll_timeout`, `poll_output`), composed
//!   of the components `docs/design.md`'s component map lists: the registry below,
//!   connections, trust, admission, transfers and L1, builds, completions, frees and
//!   their watchdog, process watches, blend, the L2 tier. Its outputs come in groups
//!   (replies, jobs, blend tables, peer actions, L2 requests, notes).
//! - [`Liveness`] (module [`liveness`]): the server's registry: two-phase
//!   registration, pings, transfers, process-exit proofs, expiry without scans, and the
//!   self-stall guard.
//! - [`Heartbeat`]: the worker's side: when to ping and when to recover, the one
//!   recovery rule both clients (Rust and Python) follow.
//! - [`protocol`]: the wire protocol's pure half (the op table, framing, typed requests
//!   and replies, error codes), shared by the server, the client, the simulator and the
//!   fuzz targets.
//! - [`l2`]: the second tier's pure half: the L2 value format, key names, the health
//!   state machine with its circuit breaker, the write-behind queue and the counters.
//!
//! # The run loop
//!
//! Feed every input, then drain every effect, then sleep until `poll_timeout`. One
//! `handle_timeout` does a bounded amount of expiry work; when a large bucket of
//! deadlines is left half done, `poll_timeout` answers an instant already passed, and
//! the loop reads its input and turns again at once:
//!
//! ```no_run
//! use kvwarden_core::{Config, Effect, Instant, Liveness, Registration};
//! # enum Input { Ping(Option<kvwarden_core::InstanceId>), Register(kvwarden_core::InstanceId) }
//! # fn clock() -> Instant { Instant::ZERO }
//! # fn wait_for_input(_deadline: Option<Instant>) -> Vec<Input> { Vec::new() }
//! # fn build_context_off_loop(_: kvwarden_core::BuildTicket) {}
//! # fn release(_: Vec<u8>) {}
//! let mut liveness: Liveness<Vec<u8>> = Liveness::new(Config::default(), clock())?;
//! loop {
//!     // 1. Block until input arrives or the core's deadline passes.
//!     let inputs = wait_for_input(liveness.poll_timeout());
//!     // 2. Socket input first: queued pings count before any deadline is judged.
//!     for input in inputs {
//!         match input {
//!             Input::Ping(instance) => {
//!                 let _tracked: bool = liveness.ping(clock(), instance);
//!             }
//!             Input::Register(instance) => {
//!                 let module = kvwarden_core::Module::ServerDriven;
//!                 if let Registration::Build(ticket) = liveness.register(clock(), instance, module) {
//!                     build_context_off_loop(ticket); // reports back with context_built
//!                 }
//!             }
//!         }
//!     }
//!     // 3. Then time.
//!     liveness.handle_timeout(clock());
//!     // 4. Drain every effect before blocking again.
//!     while let Some(effect) = liveness.poll_effect() {
//!         match effect {
//!             Effect::FreeContext { context, .. } => release(context),
//!             Effect::DropBlendState { .. } | Effect::StallDetected { .. } => {}
//!         }
//!     }
//! }
//! # #[allow(unreachable_code)]
//! # Ok::<(), kvwarden_core::ConfigError>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod heartbeat;
mod id;
pub mod kv_publish;
pub mod l2;
pub mod liveness;
mod module;
pub mod node;
pub mod protocol;
pub mod seal;
mod time;

pub use heartbeat::{
    Heartbeat, HeartbeatAction, HeartbeatConfig, PingReply, reap_timeout_floor_warning,
    reap_timeout_warning,
};
pub use id::{InstanceId, InvalidInstanceId};
pub use liveness::config::{Config, ConfigError, REAP_TIMEOUT_FLOOR};
pub use liveness::effect::{Effect, FreeCause};
pub use liveness::{BuildTicket, EntryView, Liveness, Registration, Status, TransferError};
pub use module::Module;
pub use time::Instant;
