//! Per-(instance, module) contexts: what the server holds for a worker, built and freed
//! off the event loop.
//!
//! A context is shared (`Arc`): the core holds one reference, every transfer in flight
//! another, so a free that races a copy only drops its reference and the mapping goes
//! when the copy is done.

use crate::memfd::{self, SharedMapping};
use crate::protocol::{BufferSpec, ErrorCode, ProtocolError};
use rustix::fd::OwnedFd;

/// What the server holds for one (instance, module) entry.
#[derive(Debug)]
pub enum Context {
    /// The server copies between the worker's registered buffers and L1.
    ServerDriven(ServerDrivenContext),
    // EngineDriven(TransferStrategy) arrives with the engine-driven issue: the
    // reservations and pins an instance holds in the L1 pool.
}

/// The buffers a server-driven worker registered.
#[derive(Debug)]
pub struct ServerDrivenContext {
    /// In registration order: `store`/`retrieve` name them by index.
    pub buffers: Vec<RegisteredBuffer>,
    /// The model the worker serves (status only).
    pub model_name: String,
}

/// One registered buffer.
#[derive(Debug)]
pub enum RegisteredBuffer {
    /// A worker's memfd, mapped shared. (CUDA IPC mappings join here later.)
    Memfd(SharedMapping),
}

impl RegisteredBuffer {
    /// The mapping that copies go through.
    pub fn mapping(&self) -> &SharedMapping {
        match self {
            RegisteredBuffer::Memfd(mapping) => mapping,
        }
    }
}

impl Context {
    /// The buffers of a server-driven context.
    pub fn server_driven(&self) -> Option<&ServerDrivenContext> {
        match self {
            Context::ServerDriven(context) => Some(context),
        }
    }
}

/// What a build needs: the buffer specs with the fds each memfd buffer uses.
#[derive(Debug)]
pub struct BuildRequest {
    /// The specs, each with its fd when it is a memfd.
    pub buffers: Vec<(BufferSpec, Option<OwnedFd>)>,
    /// The model name.
    pub model_name: String,
}

/// Builds a server-driven context: checks and seals each memfd, then maps it. Runs on
/// the context pool, never on the event loop.
pub fn build(request: BuildRequest) -> Result<Context, ProtocolError> {
    let mut buffers = Vec::with_capacity(request.buffers.len());
    for (index, (spec, fd)) in request.buffers.into_iter().enumerate() {
        match (spec, fd) {
            (BufferSpec::Memfd { nbytes, .. }, Some(fd)) => {
                memfd::check_and_seal(&fd, nbytes).map_err(|e| {
                    ProtocolError::new(
                        ErrorCode::BadArgs,
                        format!("register_kv_cache: buffers[{index}]: {e}"),
                    )
                })?;
                let len = usize::try_from(nbytes).map_err(|_| {
                    ProtocolError::new(
                        ErrorCode::BadArgs,
                        format!("register_kv_cache: buffers[{index}].nbytes {nbytes} does not fit this machine's address space"),
                    )
                })?;
                let mapping = SharedMapping::map(&fd, len).map_err(|e| {
                    ProtocolError::new(
                        ErrorCode::Internal,
                        format!("register_kv_cache: mapping buffers[{index}] ({nbytes} bytes) failed: {e}"),
                    )
                })?;
                // The fd is closed here; the mapping keeps the memory.
                buffers.push(RegisteredBuffer::Memfd(mapping));
            }
            (spec, _) => {
                return Err(ProtocolError::new(
                    ErrorCode::Internal,
                    format!(
                        "register_kv_cache: buffers[{index}] reached the build without its fd: {spec:?}"
                    ),
                ));
            }
        }
    }
    Ok(Context::ServerDriven(ServerDrivenContext {
        buffers,
        model_name: request.model_name,
    }))
}
