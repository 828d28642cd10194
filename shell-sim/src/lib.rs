//! kvwarden-sim: the deterministic simulator of kvwarden.
//!
//! It drives the real `kvwarden-core` (the server's request logic,
//! [`kvwarden_core::node::Node`], and one [`kvwarden_core::Heartbeat`] per worker) in
//! virtual time, with a simulated shell, network and faults, and checks the invariants
//! of `docs/failure-modes.md` at every step. It holds no model of the server. Every
//! random choice comes from one seeded generator ([`rng::Rng`]), so a seed replays bit
//! for bit.
//!
//! - [`config`]: what a run is made of; [`scenario`] reads it from TOML files,
//!   [`swarm`] draws it from a seed.
//! - [`world`]: the run itself; [`worker`], [`server`] (the shell around the node),
//!   [`message`], [`network`], [`event`]: its parts.
//! - [`pool`]: the L1 pool file that outlives a server process (row 71).
//! - [`invariants`] and [`oracle`]: what must hold, judged against a reference model.
//! - [`expect`]: a scenario's expectations.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod cli;
pub mod config;
pub mod event;
pub mod expect;
pub mod invariants;
pub mod l2;
pub mod message;
pub mod network;
pub mod oracle;
pub mod pool;
pub mod rng;
pub mod scenario;
pub mod server;
pub mod swarm;
pub mod time;
pub mod violation;
pub mod worker;
pub mod world;
