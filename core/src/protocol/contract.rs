//! The wire contract: the protocol's version and bounds, and the op table, one row per
//! op (its wire name, its arguments in the words of `docs/protocol.md`, the same
//! arguments as checks, and its reply's shape), in the order of the op index.
//!
//! Everything else reads the table: the op index and the metrics labels
//! ([`OP_NAMES`]), name lookup ([`OpKind::from_name`]) and the diagnosis of a refused
//! body (`diagnose`), and the node's check of every reply it sends ([`OpKind::reply_shape`],
//! the types in `answer`). The typed decoder (`wire_args`) and the encoder (`encode`)
//! match on [`OpKind`] exhaustively, so a new op is one new row here and a compile
//! error in each of them until they handle it.

use super::answer::ReplyShape;

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u64 = 3;

/// The deepest MessagePack nesting a valid request needs is 5 (request, args, buffers,
/// buffer map, value); anything much deeper is garbage and must not cost stack.
pub const MAX_DEPTH: usize = 16;

/// At most this many items travel in one `store_batch` or `retrieve_batch` (or keys in
/// one `lookup`): a batch is one step's blocks, and its reply and pending copies must
/// stay bounded.
pub const MAX_BATCH_ITEMS: usize = 1024;

/// The longest key (and any bin argument) accepted: keys are held in the L1 index and
/// L2 as they come, so their size is bounded like everything a peer makes the server
/// hold (failure mode 46). A content hash with a model prefix is well under it.
pub const MAX_KEY_BYTES: usize = 4096;

/// The longest string argument accepted (`model_name`, `hello`'s client name): names,
/// echoed in `status`, where five 900 KB names once made the reply too large.
pub const MAX_TEXT_BYTES: usize = 256;

/// Which op: its position in the op table is its index.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // each is the op of the same name in protocol.md
pub enum OpKind {
    Hello,
    Ping,
    RegisterKvCache,
    UnregisterKvCache,
    Store,
    Retrieve,
    StoreBatch,
    RetrieveBatch,
    Lookup,
    RegisterEngineDriven,
    UnregisterEngineDriven,
    PrepareStore,
    CommitStore,
    PrepareRetrieve,
    CommitRetrieve,
    RegisterBlend,
    Status,
    Attach,
    Auth,
    KvEvents,
    DescribeKeys,
}

/// How many ops this server knows.
pub const OP_COUNT: usize = 21;

/// The longest description `describe_keys` attaches to a key.
pub const MAX_META_BYTES: usize = 2048;

/// At most this many events (or held keys) travel in one `kv_events` reply.
pub const MAX_KV_EVENTS: usize = 1024;

/// One argument of an op: what it must be.
#[derive(Copy, Clone)]
pub(super) enum Arg {
    /// An unsigned integer, named.
    Uint(&'static str),
    /// `instance_id`: an unsigned integer no larger than `InstanceId::MAX`.
    Instance,
    /// `instance_id` or nil (ping).
    InstanceOrNil,
    /// A UTF-8 str, named.
    Text(&'static str),
    /// bin (or a str taken as its bytes), named.
    Bin(&'static str),
    /// `keys`: an array of bin.
    Keys,
    /// `buffers`: an array of buffer maps.
    Buffers,
    /// `items` of a batch: an array of `[key: bin, buffer, offset, nbytes]`.
    Items,
    /// `rope`: `{rotary_dim: uint, max_positions: uint, base: float}`.
    Rope,
    /// `hello`'s optional last argument: `{"pidfd_index": uint, "sends_fds": bool,
    /// "proof": bin, "wait_ms": uint}` (all optional, other keys ignored; `token`, which
    /// protocol 2 sent, is read only to refuse it).
    HelloOptions,
    /// `auth`'s `{"id": bin (16 bytes), "nonce": bin (32 bytes)}`.
    AuthChallenge,
    /// `items` of `describe_keys`: an array of `[key: bin, meta: bin]`.
    Descriptions,
}

/// One row of the op table.
pub(super) struct OpRow {
    pub(super) kind: OpKind,
    /// The wire name.
    pub(super) name: &'static str,
    /// What it expects, in the words of the op table.
    pub(super) expects: &'static str,
    /// Its arguments in order.
    pub(super) args: &'static [Arg],
    /// The shape of its successful reply.
    pub(super) reply: ReplyShape,
}

const KEYED: &str = "[instance_id: uint, key: bin]";
const TRANSFER: &str = "[instance_id: uint, key: bin, buffer: uint, offset: uint, nbytes: uint]";
const BATCH: &str =
    "[instance_id: uint, items: [[key: bin, buffer: uint, offset: uint, nbytes: uint]]]";
const TRANSFER_ARGS: &[Arg] = &[
    Arg::Instance,
    Arg::Bin("key"),
    Arg::Uint("buffer"),
    Arg::Uint("offset"),
    Arg::Uint("nbytes"),
];

const fn row(
    kind: OpKind,
    name: &'static str,
    expects: &'static str,
    args: &'static [Arg],
    reply: ReplyShape,
) -> OpRow {
    OpRow {
        kind,
        name,
        expects,
        args,
        reply,
    }
}

/// The op table, in index order.
pub(super) const OPS: [OpRow; OP_COUNT] = {
    use Arg::*;
    use OpKind as K;
    use ReplyShape as Shape;
    [
        row(
            K::Hello,
            "hello",
            "[protocol: uint, client: str] or [protocol: uint, client: str, options: \
             {\"pidfd_index\": uint, \"sends_fds\": bool, \"proof\": bin, \
             \"wait_ms\": uint}]",
            &[Uint("protocol"), Text("client"), HelloOptions],
            Shape::Hello,
        ),
        row(
            K::Ping,
            "ping",
            "[instance_id: uint | nil]",
            &[InstanceOrNil],
            Shape::Flag,
        ),
        row(
            K::RegisterKvCache,
            "register_kv_cache",
            "[instance_id: uint, buffers: [buffer], model_name: str, world_size: uint]",
            &[Instance, Buffers, Text("model_name"), Uint("world_size")],
            Shape::Registered,
        ),
        row(
            K::UnregisterKvCache,
            "unregister_kv_cache",
            "[instance_id: uint]",
            &[Instance],
            Shape::Flag,
        ),
        row(K::Store, "store", TRANSFER, TRANSFER_ARGS, Shape::Flag),
        row(
            K::Retrieve,
            "retrieve",
            TRANSFER,
            TRANSFER_ARGS,
            Shape::Length,
        ),
        row(
            K::StoreBatch,
            "store_batch",
            BATCH,
            &[Instance, Items],
            Shape::Stored,
        ),
        row(
            K::RetrieveBatch,
            "retrieve_batch",
            BATCH,
            &[Instance, Items],
            Shape::Lengths,
        ),
        row(K::Lookup, "lookup", "[keys: [bin]]", &[Keys], Shape::Count),
        row(
            K::RegisterEngineDriven,
            "register_engine_driven",
            "[instance_id: uint, model_name: str, world_size: uint]",
            &[Instance, Text("model_name"), Uint("world_size")],
            Shape::Registered,
        ),
        row(
            K::UnregisterEngineDriven,
            "unregister_engine_driven",
            "[instance_id: uint]",
            &[Instance],
            Shape::Flag,
        ),
        row(
            K::PrepareStore,
            "prepare_store",
            KEYED,
            &[Instance, Bin("key")],
            Shape::Reserved,
        ),
        row(
            K::CommitStore,
            "commit_store",
            "[instance_id: uint, key: bin, nbytes: uint]",
            &[Instance, Bin("key"), Uint("nbytes")],
            Shape::Flag,
        ),
        row(
            K::PrepareRetrieve,
            "prepare_retrieve",
            KEYED,
            &[Instance, Bin("key")],
            Shape::Pinned,
        ),
        row(
            K::CommitRetrieve,
            "commit_retrieve",
            KEYED,
            &[Instance, Bin("key")],
            Shape::Flag,
        ),
        row(
            K::RegisterBlend,
            "register_blend",
            "[instance_id: uint, rope: {rotary_dim: uint, max_positions: uint, base: float}]",
            &[Instance, Rope],
            Shape::Flag,
        ),
        row(K::Status, "status", "[]", &[], Shape::Status),
        row(
            K::Attach,
            "attach",
            "[instance_id: uint, secret: bin]",
            &[Instance, Bin("secret")],
            Shape::Attached,
        ),
        row(
            K::Auth,
            "auth",
            "[{\"id\": bin (16 bytes), \"nonce\": bin (32 bytes)}]",
            &[AuthChallenge],
            Shape::Challenge,
        ),
        row(
            K::KvEvents,
            "kv_events",
            "[cursor: bin, max: uint]",
            &[Bin("cursor"), Uint("max")],
            Shape::Events,
        ),
        row(
            K::DescribeKeys,
            "describe_keys",
            "[items: [[key: bin, meta: bin]]]",
            &[Descriptions],
            Shape::Stored,
        ),
    ]
};

// The table is in index order: row `i` is the op whose index is `i` (checked when the
// crate compiles).
const _: () = {
    let mut index = 0;
    while index < OP_COUNT {
        assert!(OPS[index].kind as usize == index);
        index += 1;
    }
};

/// Every op name this server knows, by op index: metrics labels and error messages.
pub const OP_NAMES: [&str; OP_COUNT] = {
    let mut names = [""; OP_COUNT];
    let mut index = 0;
    while index < OP_COUNT {
        names[index] = OPS[index].name;
        index += 1;
    }
    names
};

impl OpKind {
    /// The op's position in [`OP_NAMES`]: lets a shell keep per-op counters in an
    /// array resolved once, with no lookup by name per request.
    #[inline]
    pub fn index(self) -> usize {
        self as usize
    }

    /// The op's wire name.
    #[inline]
    pub fn name(self) -> &'static str {
        OPS[self.index()].name
    }

    /// The op of a wire name, if this server knows it.
    pub fn from_name(name: &str) -> Option<OpKind> {
        OPS.iter().find(|row| row.name == name).map(|row| row.kind)
    }

    /// The shape of the op's successful reply (the node checks every reply it sends
    /// against it).
    #[inline]
    pub fn reply_shape(self) -> ReplyShape {
        OPS[self.index()].reply
    }

    pub(super) fn row(self) -> &'static OpRow {
        &OPS[self.index()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_finds_its_own_row_and_no_two_rows_share_a_name() {
        for (index, name) in OP_NAMES.iter().enumerate() {
            let kind = OpKind::from_name(name).unwrap();
            assert_eq!(kind.index(), index, "{name}");
            assert_eq!(kind.name(), *name);
        }
        assert_eq!(OpKind::from_name("Hello"), None);
        assert_eq!(OpKind::from_name(""), None);
    }
}
