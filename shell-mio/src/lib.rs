//! kvwarden: the KV-cache server of a GPU node, and its worker client.
//!
//! The liveness rules live in [`kvwarden_core`]; this crate only translates: bytes ↔
//! messages ([`protocol`]) ↔ core calls ↔ effects ↔ syscalls ([`server`]). The
//! [`client`] is what an inference-engine worker links; it lives in its own crate
//! (`kvwarden-client`), which does not depend on this one.

pub mod cli;
pub mod cuda;
pub mod l2;
pub mod server;

pub use kvwarden_client as client;
pub use kvwarden_client::memfd;
pub use kvwarden_core::protocol;
