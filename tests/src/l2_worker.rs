//! What the L2 tests' workers do: a worker with one 1 MiB buffer, chunks of known bytes
//! stored from it, and the server's L2 counters read from its status.

use crate::Server;
use kvwarden::client::{Client, ClientConfig, Endpoint, MemfdBuffer};
use serde_json::Value as Json;
use std::sync::Arc;

/// A server-driven worker of `server` with one 1 MiB buffer registered (model `model`).
pub fn worker(server: &Server, model: &str) -> (Client, Arc<MemfdBuffer>) {
    let client = Client::connect(ClientConfig::new(Endpoint::Unix(server.socket.clone())))
        .expect("connecting");
    let buffer = Arc::new(MemfdBuffer::new(1 << 20).expect("a memfd"));
    client
        .register(vec![Arc::clone(&buffer)], model, 1)
        .expect("registering");
    (client, buffer)
}

/// `len` bytes of chunk `seed`: distinct per seed and per byte.
pub fn chunk(seed: u64, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) as u8)
        .collect()
}

/// Stores `bytes` under `key` from offset 0 of the worker's buffer.
pub fn store(client: &Client, buffer: &MemfdBuffer, key: &[u8], bytes: &[u8]) {
    assert!(buffer.write(0, bytes));
    assert!(client.store(key, 0, 0, bytes.len() as u64).expect("store"));
}

/// The L2 counter `field` of a status (`l2.<field>`).
pub fn l2_counter(status: &Json, field: &str) -> u64 {
    status["l2"][field]
        .as_u64()
        .unwrap_or_else(|| panic!("l2.{field} in {status}"))
}

/// Waits until `server` has written at least `writes` values to L2.
pub fn wait_written(server: &Server, writes: u64) {
    server.wait_status(&format!("{writes} L2 writes"), |status| {
        l2_counter(status, "writes") >= writes
    });
}
