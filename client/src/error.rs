//! What can go wrong for a client call.

use kvwarden_core::protocol::{ErrorCode, ProtocolError};
use thiserror::Error;

/// What can go wrong for a client call.
#[derive(Debug, Error)]
pub enum ClientError {
    /// The connection failed or broke (the server may be restarting).
    #[error("connection to the kvwarden server at {endpoint} failed: {source}")]
    Io {
        /// Where.
        endpoint: String,
        /// The error.
        source: std::io::Error,
    },
    /// The server answered with an error.
    #[error("the server refused `{op}`: {error}")]
    Server {
        /// The op.
        op: String,
        /// The error reply.
        error: ProtocolError,
    },
    /// The server's reply made no sense.
    #[error("unexpected reply to `{op}`: {detail}")]
    Reply {
        /// The op.
        op: String,
        /// What was wrong.
        detail: String,
    },
    /// A local resource (a memfd) could not be set up.
    #[error("{0}")]
    Local(String),
    /// The process answering on the socket runs as a uid this client does not trust:
    /// nothing was sent to it.
    #[error(
        "refusing to talk to the server at {socket}: it runs as uid {uid}, which is neither \
         root, this process's uid ({own_uid}), nor in ClientConfig::trusted_server_uids \
         ({trusted:?}); another user may have created the socket first. Check the socket \
         path, or add uid {uid} to trusted_server_uids if that user runs your server"
    )]
    UntrustedServer {
        /// The socket.
        socket: String,
        /// The server's uid.
        uid: u32,
        /// This process's uid.
        own_uid: u32,
        /// The uids trusted besides root and our own.
        trusted: Vec<u32>,
    },
    /// The process answering on a TCP address could not prove it holds this client's
    /// token: nothing secret was sent to it.
    #[error(
        "refusing to talk to the server at {endpoint}: it could not prove it holds this \
         client's TCP token ({why}), so it is not the kvwarden server configured with that \
         token (another process may be listening on that port, or the server has another \
         token). The token was not sent. Check the address and the token file"
    )]
    ServerNotProven {
        /// The address.
        endpoint: String,
        /// What it answered.
        why: String,
    },
    /// Over TCP, no token to prove: the server answers nothing else.
    #[error(
        "the server at {endpoint} is reached over TCP, which needs its token: set \
         ClientConfig::tcp_token (ClientConfig::read_tcp_token_file, or the CLI's \
         --tcp-token-file) to the contents of the server's --tcp-token-file"
    )]
    NoTcpToken {
        /// The address.
        endpoint: String,
    },
}

impl ClientError {
    /// The server's error code, if this is an error reply.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { error, .. } => Some(error.code),
            _ => None,
        }
    }
}
