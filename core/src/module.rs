//! Where a worker's per-instance state lives on the server: the two modules.
//!
//! Its own file so that the registry, the effects and the expiry queue all depend on it
//! and not on one another.

/// Where a worker's per-instance state lives on the server.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Module {
    /// The server copies KV data in and out of memory the worker registered
    /// (CUDA IPC mappings, or memfd mappings on hosts without a GPU).
    ServerDriven,
    /// The worker copies KV data in and out of slots of a server-owned pool;
    /// the server keeps a transfer strategy (pending reservations, pins) per instance.
    EngineDriven,
}

impl Module {
    /// Every module, in a fixed order.
    pub const ALL: [Module; 2] = [Module::ServerDriven, Module::EngineDriven];

    pub(crate) const fn index(self) -> usize {
        match self {
            Module::ServerDriven => 0,
            Module::EngineDriven => 1,
        }
    }

    /// A short stable label for logs and metrics: `server_driven`, `engine_driven`.
    pub fn label(self) -> &'static str {
        match self {
            Module::ServerDriven => "server_driven",
            Module::EngineDriven => "engine_driven",
        }
    }
}
