//! Error codes of the protocol and the typed errors that carry them.

use thiserror::Error;

/// An error code of `protocol.md`, as it travels on the wire.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The stream can no longer be trusted; the server closes the connection.
    BadFrame,
    /// A frame longer than `--max-frame-bytes`; the server closes the connection.
    TooLarge,
    /// The op is not one this server knows.
    UnknownOp,
    /// Wrong count or types of arguments, or values out of range.
    BadArgs,
    /// The instance is not registered here: re-register.
    NotRegistered,
    /// The instance's context is still being built.
    NotReady,
    /// The instance belongs to another user id.
    Forbidden,
    /// The feature is not available on this server (no GPU, not built yet).
    Unavailable,
    /// The server is at a limit; try again later.
    Overloaded,
    /// A bug or an unexpected system error on the server.
    Internal,
}

impl ErrorCode {
    /// Every code, in the order of `protocol.md`.
    pub const ALL: [ErrorCode; 10] = [
        ErrorCode::BadFrame,
        ErrorCode::TooLarge,
        ErrorCode::UnknownOp,
        ErrorCode::BadArgs,
        ErrorCode::NotRegistered,
        ErrorCode::NotReady,
        ErrorCode::Forbidden,
        ErrorCode::Unavailable,
        ErrorCode::Overloaded,
        ErrorCode::Internal,
    ];

    /// The code as it is spelled on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadFrame => "bad_frame",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::UnknownOp => "unknown_op",
            ErrorCode::BadArgs => "bad_args",
            ErrorCode::NotRegistered => "not_registered",
            ErrorCode::NotReady => "not_ready",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::Internal => "internal",
        }
    }

    /// Parses a wire spelling; unknown spellings (a newer server) map to `Internal`.
    pub fn parse(text: &str) -> ErrorCode {
        ErrorCode::ALL
            .into_iter()
            .find(|code| code.as_str() == text)
            .unwrap_or(ErrorCode::Internal)
    }

    /// Whether the server closes the connection after replying with this code.
    pub fn closes_connection(self) -> bool {
        matches!(self, ErrorCode::BadFrame | ErrorCode::TooLarge)
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error reply: a code and a message for a human.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{code}: {message}")]
pub struct ProtocolError {
    /// The wire code.
    pub code: ErrorCode,
    /// What was wrong, the value seen and what would be right.
    pub message: String,
}

impl ProtocolError {
    /// An error with `code` and `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ProtocolError {
        ProtocolError {
            code,
            message: message.into(),
        }
    }
}

/// A request that could not be decoded: the error to reply with, and the request id
/// to reply to when it could be read (0 otherwise).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("request {request_id:?}: {error}")]
pub struct DecodeError {
    /// The request id, when the frame got that far.
    pub request_id: Option<u64>,
    /// The reply to send.
    pub error: ProtocolError,
}
