//! kvwarden: the KV-cache server of a GPU node, and its worker client.
//!
//! The liveness rules live in [`kvwarden_core`]; this crate only translates: bytes ↔
//! messages ([`protocol`]) ↔ core calls ↔ effects ↔ syscalls ([`server`]). The
//! [`client`] is what an inference-engine worker links.

pub mod bench;
pub mod cli;
pub mod client;
pub mod cuda;
pub mod memfd;
pub use kvwarden_core::protocol;
pub mod server;
