//! The client's settings, and the worker's identity (its instance id and secret).

use crate::wire::Endpoint;
use kvwarden_core::{HeartbeatConfig, InstanceId};
use std::time::Duration;

use crate::ClientError;

/// Client settings.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Where the server listens.
    pub endpoint: Endpoint,
    /// The heartbeat interval (also a ping's timeout). Default 10 s.
    pub heartbeat_interval: Duration,
    /// The instance id; None draws a fresh uuid-derived one.
    pub instance_id: Option<InstanceId>,
    /// The secret drawn with the id; None draws 32 bytes from the OS (always, for a
    /// worker: its secret is what makes the instance its own). Only a tool that shares
    /// one instance between processes of its own sets it (the benchmarks, the demo).
    pub instance_secret: Option<[u8; 32]>,
    /// The name sent in `hello`.
    pub client_name: String,
    /// How long any other request may take.
    pub request_timeout: Duration,
    /// Send a pidfd of this process with every `hello` over a Unix socket (default
    /// true): the server then frees this worker's state within milliseconds of its
    /// death even where it cannot see the worker's pid (another PID namespace, no
    /// `hostPID`). Off: the server proves the death only by pid, where visible.
    pub send_pidfd: bool,
    /// Server uids to trust besides root and this process's own (Unix socket only):
    /// any other is refused before a single fd is sent.
    pub trusted_server_uids: Vec<u32>,
    /// The token a TCP `hello` presents (the contents of the server's
    /// `--tcp-token-file`); see [`ClientConfig::read_tcp_token_file`].
    pub tcp_token: Option<Vec<u8>>,
}

impl ClientConfig {
    /// Defaults for `endpoint`.
    pub fn new(endpoint: Endpoint) -> ClientConfig {
        ClientConfig {
            endpoint,
            heartbeat_interval: HeartbeatConfig::default().interval,
            instance_id: None,
            instance_secret: None,
            client_name: concat!("kvwarden-client ", env!("CARGO_PKG_VERSION")).to_string(),
            request_timeout: Duration::from_secs(30),
            send_pidfd: true,
            trusted_server_uids: Vec::new(),
            tcp_token: None,
        }
    }

    /// Reads the TCP token from `path` (surrounding whitespace stripped): tokens never
    /// travel on a command line.
    pub fn read_tcp_token_file(path: &std::path::Path) -> Result<Vec<u8>, ClientError> {
        let text = std::fs::read(path).map_err(|error| {
            ClientError::Local(format!(
                "cannot read the TCP token file {}: {error}; it holds the token the server's \
                 --tcp-token-file names",
                path.display()
            ))
        })?;
        let token = text.trim_ascii().to_vec();
        if token.is_empty() {
            return Err(ClientError::Local(format!(
                "the TCP token file {} is empty",
                path.display()
            )));
        }
        Ok(token)
    }
}

/// The worker's identity: its instance id and the secret drawn with it.
#[derive(Clone, Copy)]
pub(crate) struct Identity {
    pub(crate) instance: InstanceId,
    pub(crate) secret: [u8; 32],
}

impl Identity {
    pub(crate) fn generate(instance: Option<InstanceId>) -> Identity {
        let mut secret = [0u8; 32];
        // The OS's entropy; a process that cannot get it has no business registering.
        getrandom::fill(&mut secret).expect("the OS random source (getrandom) failed");
        Identity {
            instance: instance.unwrap_or_else(InstanceId::generate),
            secret,
        }
    }
}
