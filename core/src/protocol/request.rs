//! Requests as typed values: [`Request`], [`Op`] and their argument types. Their
//! wire form is the op table's ([`super::contract`]); `wire_args` decodes them and
//! `encode` writes them.

use super::contract::OpKind;
use super::tcp_auth::{KeyId, Nonce};
use crate::InstanceId;

/// A decoded request.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The id the reply must carry.
    pub id: u64,
    /// What is asked.
    pub op: Op,
}

/// A buffer a worker registers.
#[derive(Clone, Debug, PartialEq)]
pub enum BufferSpec {
    /// Host memory shared as a memfd sent with the frame (`SCM_RIGHTS`).
    Memfd {
        /// Index of the fd among those that arrived with the frame.
        fd_index: u64,
        /// Bytes the worker claims the memfd holds.
        nbytes: u64,
    },
    /// A `cuIpcGetMemHandle` handle of an allocation's base.
    CudaIpc {
        /// The CUDA device ordinal.
        device: u64,
        /// The 64-byte IPC handle.
        handle: Vec<u8>,
        /// Where the buffer starts inside the allocation.
        offset: u64,
        /// The buffer's length.
        nbytes: u64,
    },
    /// A CUDA virtual-memory allocation (`cuMemCreate`: expandable segments, vLLM's
    /// sleep-mode pool): the POSIX fd `cuMemExportToShareableHandle` gave, sent with the
    /// frame (`SCM_RIGHTS`), imported and mapped by the server.
    CudaVmm {
        /// Index of the fd among those that arrived with the frame.
        fd_index: u64,
        /// The CUDA device ordinal.
        device: u64,
        /// The allocation's size, as `cuMemCreate` made it: the server maps all of it.
        allocation_bytes: u64,
        /// Where the buffer starts inside the allocation.
        offset: u64,
        /// The buffer's length.
        nbytes: u64,
    },
}

impl BufferSpec {
    /// The wire name of the buffer's kind.
    pub fn kind(&self) -> &'static str {
        match self {
            BufferSpec::Memfd { .. } => "memfd",
            BufferSpec::CudaIpc { .. } => "cuda_ipc",
            BufferSpec::CudaVmm { .. } => "cuda_vmm",
        }
    }

    /// The index of the fd the buffer travels with (`SCM_RIGHTS`), for the kinds that
    /// have one.
    pub fn fd_index(&self) -> Option<u64> {
        match self {
            BufferSpec::Memfd { fd_index, .. } | BufferSpec::CudaVmm { fd_index, .. } => {
                Some(*fd_index)
            }
            BufferSpec::CudaIpc { .. } => None,
        }
    }

    /// The CUDA device the buffer lives on, for the device kinds.
    pub fn cuda_device(&self) -> Option<u64> {
        match self {
            BufferSpec::CudaIpc { device, .. } | BufferSpec::CudaVmm { device, .. } => {
                Some(*device)
            }
            BufferSpec::Memfd { .. } => None,
        }
    }

    /// The buffer's length: the bytes `store` and `retrieve` may address in it.
    pub fn nbytes(&self) -> u64 {
        match self {
            BufferSpec::Memfd { nbytes, .. }
            | BufferSpec::CudaIpc { nbytes, .. }
            | BufferSpec::CudaVmm { nbytes, .. } => *nbytes,
        }
    }
}

/// One item of `store_batch`: what `store` takes, less the instance.
#[derive(Clone, Debug, PartialEq)]
pub struct StoreItem {
    /// The L1 key.
    pub key: Vec<u8>,
    /// Index of the registered buffer.
    pub buffer: u64,
    /// Where the bytes start in the buffer.
    pub offset: u64,
    /// How many bytes (at most one L1 slot).
    pub nbytes: u64,
}

/// One item of `retrieve_batch`: what `retrieve` takes, less the instance.
#[derive(Clone, Debug, PartialEq)]
pub struct RetrieveItem {
    /// The L1 key.
    pub key: Vec<u8>,
    /// Index of the registered buffer.
    pub buffer: u64,
    /// Where the bytes go in the buffer.
    pub offset: u64,
    /// The destination's length: a stored value of another length is a miss.
    pub nbytes: u64,
}

/// CacheBlend rope parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    /// Rotary dimension.
    pub rotary_dim: u64,
    /// Positions to precompute.
    pub max_positions: u64,
    /// RoPE base.
    pub base: f64,
}

/// An op with its arguments.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)] // the fields are those of the op table in protocol.md
pub enum Op {
    Hello {
        protocol: u64,
        client: String,
        /// Index among the frame's fds of a pidfd of the sending process (the optional
        /// third argument, `{"pidfd_index": uint}`).
        pidfd_index: Option<u64>,
        /// False when the connection promises to send no fds after this `hello`
        /// (`{"sends_fds": false}`): the server then reads it with plain `read(2)`,
        /// which is cheaper than `recvmsg(2)`. True when absent.
        sends_fds: bool,
        /// What protocol 2 sent over TCP (`{"token": str | bin}`): read only to refuse
        /// it, naming the change (the token no longer travels).
        token: Option<Vec<u8>>,
        /// Over TCP, the client's proof for this connection's `auth` (`{"proof": bin}`,
        /// [`tcp_auth`](super::tcp_auth)); ignored over the Unix socket.
        proof: Option<Vec<u8>>,
        /// How long the client waits for a reply on this connection, in milliseconds
        /// (`{"wait_ms": uint}`): past it the server starts no copy into the worker's
        /// memory for a request of this connection (failure mode 60). None: no bound.
        wait_ms: Option<u64>,
    },
    /// Over TCP, opens the challenge: the client's token's key id and its nonce.
    Auth {
        id: KeyId,
        nonce: Nonce,
    },
    /// Proves (or claims) an instance for this connection with the worker's secret.
    Attach {
        instance: InstanceId,
        secret: Vec<u8>,
    },
    Ping {
        instance: Option<InstanceId>,
    },
    RegisterKvCache {
        instance: InstanceId,
        buffers: Vec<BufferSpec>,
        model_name: String,
        world_size: u64,
    },
    UnregisterKvCache {
        instance: InstanceId,
    },
    Store {
        instance: InstanceId,
        key: Vec<u8>,
        buffer: u64,
        offset: u64,
        nbytes: u64,
    },
    Retrieve {
        instance: InstanceId,
        key: Vec<u8>,
        buffer: u64,
        offset: u64,
        nbytes: u64,
    },
    StoreBatch {
        instance: InstanceId,
        items: Vec<StoreItem>,
    },
    RetrieveBatch {
        instance: InstanceId,
        items: Vec<RetrieveItem>,
    },
    Lookup {
        keys: Vec<Vec<u8>>,
    },
    RegisterEngineDriven {
        instance: InstanceId,
        model_name: String,
        world_size: u64,
    },
    UnregisterEngineDriven {
        instance: InstanceId,
    },
    PrepareStore {
        instance: InstanceId,
        key: Vec<u8>,
    },
    CommitStore {
        instance: InstanceId,
        key: Vec<u8>,
        nbytes: u64,
    },
    PrepareRetrieve {
        instance: InstanceId,
        key: Vec<u8>,
    },
    CommitRetrieve {
        instance: InstanceId,
        key: Vec<u8>,
    },
    RegisterBlend {
        instance: InstanceId,
        rope: RopeSpec,
    },
    Status,
    /// What entered and left L1 in the caller's tenant since `cursor` (empty: from the
    /// start, a resync), at most `max` changes.
    KvEvents {
        cursor: Vec<u8>,
        max: u64,
    },
    /// Attaches `meta` (what the key's value is, for `kv_events` readers) to each key
    /// L1 holds in the caller's tenant.
    DescribeKeys {
        items: Vec<(Vec<u8>, Vec<u8>)>,
    },
}

impl Op {
    /// Which op it is: its row of the op table.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Hello { .. } => OpKind::Hello,
            Op::Ping { .. } => OpKind::Ping,
            Op::RegisterKvCache { .. } => OpKind::RegisterKvCache,
            Op::UnregisterKvCache { .. } => OpKind::UnregisterKvCache,
            Op::Store { .. } => OpKind::Store,
            Op::Retrieve { .. } => OpKind::Retrieve,
            Op::StoreBatch { .. } => OpKind::StoreBatch,
            Op::RetrieveBatch { .. } => OpKind::RetrieveBatch,
            Op::Lookup { .. } => OpKind::Lookup,
            Op::RegisterEngineDriven { .. } => OpKind::RegisterEngineDriven,
            Op::UnregisterEngineDriven { .. } => OpKind::UnregisterEngineDriven,
            Op::PrepareStore { .. } => OpKind::PrepareStore,
            Op::CommitStore { .. } => OpKind::CommitStore,
            Op::PrepareRetrieve { .. } => OpKind::PrepareRetrieve,
            Op::CommitRetrieve { .. } => OpKind::CommitRetrieve,
            Op::RegisterBlend { .. } => OpKind::RegisterBlend,
            Op::Status => OpKind::Status,
            Op::Attach { .. } => OpKind::Attach,
            Op::Auth { .. } => OpKind::Auth,
            Op::KvEvents { .. } => OpKind::KvEvents,
            Op::DescribeKeys { .. } => OpKind::DescribeKeys,
        }
    }

    /// The op's wire name.
    #[inline]
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// The op's position in [`OP_NAMES`](super::OP_NAMES): lets a shell keep per-op
    /// counters in an array resolved once, with no lookup by name per request.
    #[inline]
    pub fn index(&self) -> usize {
        self.kind().index()
    }

    /// The instance the op names, if any (ownership is checked against it).
    pub fn instance(&self) -> Option<InstanceId> {
        match self {
            Op::Hello { .. }
            | Op::Auth { .. }
            | Op::Lookup { .. }
            | Op::Status
            | Op::KvEvents { .. }
            | Op::DescribeKeys { .. } => None,
            Op::Ping { instance } => *instance,
            Op::Attach { instance, .. }
            | Op::RegisterKvCache { instance, .. }
            | Op::UnregisterKvCache { instance }
            | Op::Store { instance, .. }
            | Op::Retrieve { instance, .. }
            | Op::StoreBatch { instance, .. }
            | Op::RetrieveBatch { instance, .. }
            | Op::RegisterEngineDriven { instance, .. }
            | Op::UnregisterEngineDriven { instance }
            | Op::PrepareStore { instance, .. }
            | Op::CommitStore { instance, .. }
            | Op::PrepareRetrieve { instance, .. }
            | Op::CommitRetrieve { instance, .. }
            | Op::RegisterBlend { instance, .. } => Some(*instance),
        }
    }
}
