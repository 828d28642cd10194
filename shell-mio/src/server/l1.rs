//! The L1 pool's memory: one anonymous memfd of fixed-size slots, mapped once; or,
//! with `--l1-file`, a file a restart finds again, with an index of seals beside it
//! (rows 71–73; the format is [`kvwarden_core::seal`]).
//!
//! Which key holds which slot (reservations, pins, LRU) is the node's bookkeeping
//! ([`kvwarden_core::node::l1`]); the bytes are copied here, on the context pool, at
//! the offsets it names.

use super::systemd;
use crate::memfd::{self, SharedMapping};
use kvwarden_core::node::Scanned;
use kvwarden_core::seal::{self, Geometry, IndexHeader, SEAL_BYTES, SealKey};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{Mode, OFlags, SealFlags};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use kvwarden_core::node::l1::SlotId;

/// The pool.
#[derive(Debug)]
pub struct L1 {
    mapping: Arc<SharedMapping>,
    /// The pool's memfd, kept to hand to engine-driven workers (`SCM_RIGHTS`); sealed
    /// against resizing, so no worker can shrink it under the server's mapping.
    fd: OwnedFd,
    slot_bytes: u64,
    num_slots: usize,
    /// The seals of a pool file (`--l1-file` with `--l1-secret-file`).
    seals: Option<Arc<Seals>>,
}

/// A pool file's index of seals, mapped, and the key they are made with.
#[derive(Debug)]
pub struct Seals {
    index: SharedMapping,
    _fd: OwnedFd,
    key: SealKey,
    geometry: Geometry,
}

/// How a pool file was found at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolStart {
    /// An anonymous pool: nothing outlives the process.
    Anonymous,
    /// Its seals may be checked: the node adopts what verifies.
    Adopt,
    /// Started empty, and why (a new file, another geometry, another secret, no secret).
    Cold(String),
}

impl L1 {
    /// A pool of `l1_bytes / slot_bytes` slots in one anonymous memfd; with `prefault`
    /// every page is allocated now rather than on its first write.
    pub fn new(l1_bytes: u64, slot_bytes: u64, prefault: bool) -> std::io::Result<L1> {
        let num_slots = l1_bytes.checked_div(slot_bytes).unwrap_or(0);
        let used = num_slots * slot_bytes;
        let fd = memfd::create("kvwarden-l1", used)?;
        // Engine-driven workers get this fd: a shrink would turn the server's next copy
        // into SIGBUS, a grow is pointless, and F_SEAL_SEAL keeps it that way.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let len = usize::try_from(used).map_err(std::io::Error::other)?;
        let mapping = Arc::new(SharedMapping::map(&fd, len)?);
        if prefault {
            mapping.populate()?;
        }
        let num_slots = usize::try_from(num_slots).map_err(std::io::Error::other)?;
        Ok(L1 {
            mapping,
            fd,
            slot_bytes,
            num_slots,
            seals: None,
        })
    }

    /// A pool in the file at `path` (on tmpfs or hugetlbfs: it outlives the process,
    /// not the machine), with its index of seals at `path.index`. With `key`, every
    /// committed value is sealed, and a pool of this geometry sealed under this key is
    /// adopted ([`PoolStart::Adopt`]); anything else starts empty and says why. A file
    /// that is not the server's own, mode 0600, is refused: it could have been edited
    /// or read by someone else.
    pub fn open_file(
        path: &Path,
        l1_bytes: u64,
        slot_bytes: u64,
        prefault: bool,
        key: Option<SealKey>,
    ) -> Result<(L1, PoolStart), String> {
        let num_slots = l1_bytes.checked_div(slot_bytes).unwrap_or(0);
        let used = num_slots * slot_bytes;
        let geometry = Geometry {
            slot_bytes,
            num_slots,
        };
        let index_path = index_path(path);
        let fd = open_own(path)?;
        let index_fd = open_own(&index_path)?;
        let size_of = |fd: &OwnedFd, path: &Path| {
            rustix::fs::fstat(fd)
                .map(|stat| stat.st_size as u64)
                .map_err(|e| format!("--l1-file {}: {e}", path.display()))
        };
        let (pool_size, index_size) = (size_of(&fd, path)?, size_of(&index_fd, &index_path)?);
        let mut head = [0u8; 64];
        let read = rustix::io::pread(&index_fd, &mut head, 0).unwrap_or(0);
        let start = file_start(
            key.as_ref(),
            &head[..read],
            geometry,
            (pool_size, index_size),
            &index_path,
        );
        let resize = |fd: &OwnedFd, path: &Path, len: u64| {
            rustix::fs::ftruncate(fd, 0)
                .and_then(|()| rustix::fs::ftruncate(fd, len))
                .map_err(|e| {
                    format!(
                        "--l1-file {}: sizing it to {len} bytes: {e}",
                        path.display()
                    )
                })
        };
        if start != PoolStart::Adopt {
            // Emptied whole: nothing of the old pool stays to be read by mistake.
            resize(&fd, path, used)?;
            resize(&index_fd, &index_path, geometry.index_bytes())?;
            if let Some(key) = &key {
                rustix::io::pwrite(&index_fd, &seal::index_header(geometry, key), 0)
                    .map_err(|e| format!("--l1-file {}: {e}", index_path.display()))?;
            }
        }
        let mapping = Arc::new(map_file(&fd, used, path)?);
        if prefault {
            mapping
                .populate()
                .map_err(|e| format!("--l1-prefault of {}: {e}", path.display()))?;
        }
        let seals = match key {
            Some(key) => Some(Arc::new(
                Seals::map(index_fd, geometry, key)
                    .map_err(|e| format!("--l1-file {}: {e}", index_path.display()))?,
            )),
            None => None,
        };
        let num_slots = usize::try_from(num_slots).map_err(|e| e.to_string())?;
        Ok((
            L1 {
                mapping,
                fd,
                slot_bytes,
                num_slots,
                seals,
            },
            start,
        ))
    }

    /// The pool file's seals, None for an anonymous pool or one without a secret.
    pub fn seals(&self) -> Option<&Arc<Seals>> {
        self.seals.as_ref()
    }

    /// The pool's mapping (copies run against it off the loop).
    pub fn mapping(&self) -> &Arc<SharedMapping> {
        &self.mapping
    }

    /// The pool's memfd (sealed against resizing), for engine-driven workers to map.
    pub fn pool_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Slots in the pool.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Where `slot` begins in the pool.
    pub fn offset(&self, slot: SlotId) -> u64 {
        slot as u64 * self.slot_bytes
    }
}

/// `len` bytes of the pool file at `path`, mapped shared.
fn map_file(fd: &OwnedFd, len: u64, path: &Path) -> Result<SharedMapping, String> {
    usize::try_from(len)
        .map_err(std::io::Error::other)
        .and_then(|len| SharedMapping::map(fd, len))
        .map_err(|e| format!("--l1-file {}: mapping {len} bytes: {e}", path.display()))
}

/// What a pool file and its index found at start allow: adopted, or why the pool
/// starts cold (a new file, no secret, or the index's verdict).
fn file_start(
    key: Option<&SealKey>,
    head: &[u8],
    geometry: Geometry,
    (pool_size, index_size): (u64, u64),
    index_path: &Path,
) -> PoolStart {
    match key {
        None if pool_size == 0 => PoolStart::Cold("a new pool file".into()),
        None => PoolStart::Cold(
            "no --l1-secret-file: there is nothing to authenticate the pool's values \
             with, so none is served again"
                .into(),
        ),
        Some(key) => verdict(
            seal::check_index_header(head, geometry, key),
            geometry,
            (pool_size, index_size),
            || "a new pool file".into(),
            || {
                format!(
                    "{} holds no index of seals for this pool: nothing to verify its \
                     values with",
                    index_path.display()
                )
            },
        ),
    }
}

/// What a pool and its index found at start allow: [`PoolStart::Adopt`] for this
/// geometry and secret with both of their sizes, else why it starts cold (`new` when
/// the pool is empty, `unindexed` when it has no index for it).
fn verdict(
    header: IndexHeader,
    geometry: Geometry,
    (pool_size, index_size): (u64, u64),
    new: impl FnOnce() -> String,
    unindexed: impl FnOnce() -> String,
) -> PoolStart {
    let used = geometry.slot_bytes * geometry.num_slots;
    match header {
        IndexHeader::Matches if pool_size == used && index_size == geometry.index_bytes() => {
            PoolStart::Adopt
        }
        IndexHeader::Matches | IndexHeader::Blank if pool_size == 0 => PoolStart::Cold(new()),
        IndexHeader::Matches | IndexHeader::Blank => PoolStart::Cold(unindexed()),
        IndexHeader::OtherGeometry(old) => PoolStart::Cold(format!(
            "the pool was made with --slot-bytes {} and {} slots; this server has \
             --slot-bytes {} and {} slots (--l1-bytes), so its values are dropped",
            old.slot_bytes, old.num_slots, geometry.slot_bytes, geometry.num_slots
        )),
        IndexHeader::OtherSecret => PoolStart::Cold(
            "the pool was sealed under another --l1-secret-file: its values are dropped".into(),
        ),
    }
}

impl L1 {
    /// A pool kept in systemd's file-descriptor store (`--l1-fdstore`): the sealed
    /// memfds of an earlier start when `passed` holds them (`LISTEN_FDNAMES`
    /// [`systemd::POOL_FD_NAME`] and [`systemd::INDEX_FD_NAME`]) and they are of this
    /// geometry and sealed under `key`: adopted. Else new memfds, handed to the store
    /// (replacing the old), and why the pool starts cold. Without `key`, or outside
    /// systemd, an anonymous pool that is not stored.
    pub fn open_fdstore(
        passed: &mut Vec<(OwnedFd, String)>,
        l1_bytes: u64,
        slot_bytes: u64,
        prefault: bool,
        key: Option<SealKey>,
    ) -> Result<(L1, PoolStart), String> {
        let geometry = Geometry {
            slot_bytes,
            num_slots: l1_bytes.checked_div(slot_bytes).unwrap_or(0),
        };
        let mut take = |name: &str| {
            let at = passed.iter().position(|(_, passed)| passed == name)?;
            Some(passed.remove(at).0)
        };
        let (old_pool, old_index) = (take(systemd::POOL_FD_NAME), take(systemd::INDEX_FD_NAME));
        let fresh = || {
            L1::new(l1_bytes, slot_bytes, prefault)
                .map_err(|e| format!("creating the L1 pool of {l1_bytes} bytes: {e}"))
        };
        let Some(key) = key else {
            return Ok((
                fresh()?,
                PoolStart::Cold(
                    "--l1-fdstore without --l1-secret-file: there is nothing to authenticate \
                     the pool's values with, so it is not kept"
                        .into(),
                ),
            ));
        };
        if !systemd::supervised() {
            return Ok((
                fresh()?,
                PoolStart::Cold(
                    "--l1-fdstore, but NOTIFY_SOCKET is not set (not a systemd service of \
                     Type=notify): the pool is not kept"
                        .into(),
                ),
            ));
        }
        let start = stored_start(old_pool.as_ref(), old_index.as_ref(), geometry, &key);
        if start == PoolStart::Adopt
            && let (Some(pool), Some(index)) = (old_pool, old_index)
        {
            let l1 = L1::adopt_stored(pool, index, geometry, key, prefault)?;
            return Ok((l1, start));
        }
        let l1 = L1::store_fresh(fresh()?, geometry, key)?;
        Ok((l1, start))
    }

    /// The pool and index systemd handed back, mapped: adopted.
    fn adopt_stored(
        pool: OwnedFd,
        index: OwnedFd,
        geometry: Geometry,
        key: SealKey,
        prefault: bool,
    ) -> Result<L1, String> {
        let len =
            usize::try_from(geometry.slot_bytes * geometry.num_slots).map_err(|e| e.to_string())?;
        let mapping = Arc::new(
            SharedMapping::map(&pool, len)
                .map_err(|e| format!("mapping the stored L1 pool: {e}"))?,
        );
        if prefault {
            mapping
                .populate()
                .map_err(|e| format!("--l1-prefault of the stored pool: {e}"))?;
        }
        let seals = Seals::map(index, geometry, key)?;
        let num_slots = usize::try_from(geometry.num_slots).map_err(|e| e.to_string())?;
        Ok(L1 {
            mapping,
            fd: pool,
            slot_bytes: geometry.slot_bytes,
            num_slots,
            seals: Some(Arc::new(seals)),
        })
    }

    /// A new pool with a new index of seals (its header written, sealed against
    /// resizing), both handed to systemd's file-descriptor store, replacing the old.
    fn store_fresh(mut l1: L1, geometry: Geometry, key: SealKey) -> Result<L1, String> {
        let index = memfd::create("kvwarden-l1-index", geometry.index_bytes())
            .map_err(|e| format!("creating the L1 index: {e}"))?;
        rustix::fs::fcntl_add_seals(
            &index,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
        )
        .map_err(|e| format!("sealing the L1 index: {e}"))?;
        rustix::io::pwrite(&index, &seal::index_header(geometry, &key), 0)
            .map_err(|e| format!("writing the L1 index: {e}"))?;
        for (name, fd) in [
            (systemd::POOL_FD_NAME, l1.fd.as_fd()),
            (systemd::INDEX_FD_NAME, index.as_fd()),
        ] {
            systemd::store(name, fd).map_err(|e| {
                format!("handing {name} to systemd's file-descriptor store (FDSTORE=1): {e}")
            })?;
        }
        l1.seals = Some(Arc::new(Seals::map(index, geometry, key)?));
        Ok(l1)
    }
}

/// What the pool and index systemd passed (if it passed both) allow: adopted, or why
/// the pool starts cold.
fn stored_start(
    old_pool: Option<&OwnedFd>,
    old_index: Option<&OwnedFd>,
    geometry: Geometry,
    key: &SealKey,
) -> PoolStart {
    match (old_pool, old_index) {
        (Some(pool), Some(index)) => {
            let size = |fd: &OwnedFd| rustix::fs::fstat(fd).map_or(0, |stat| stat.st_size as u64);
            let mut head = [0u8; 64];
            let read = rustix::io::pread(index, &mut head, 0).unwrap_or(0);
            verdict(
                seal::check_index_header(&head[..read], geometry, key),
                geometry,
                (size(pool), size(index)),
                || "an empty pool in systemd's file-descriptor store".into(),
                || "the pool in systemd's file-descriptor store has no index of seals".into(),
            )
        }
        _ => PoolStart::Cold(
            "nothing in systemd's file-descriptor store yet (a first start, or the store \
             was released: FileDescriptorStoreMax= and FileDescriptorStorePreserve= of \
             the unit)"
                .into(),
        ),
    }
}

/// Where a pool file's index of seals lies.
pub fn index_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".index");
    PathBuf::from(name)
}

/// Opens (or makes) `path` for the pool: a regular file of the server's own uid and
/// mode 0600, else refused with the fix named.
fn open_own(path: &Path) -> Result<OwnedFd, String> {
    let fd = rustix::fs::open(
        path,
        OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| {
        format!(
            "--l1-file {}: cannot open it: {e} (name a path on a tmpfs or hugetlbfs mount \
             the server's uid may write, such as /dev/shm/kvwarden-l1)",
            path.display()
        )
    })?;
    let stat = rustix::fs::fstat(&fd).map_err(|e| format!("--l1-file {}: {e}", path.display()))?;
    let me = rustix::process::geteuid().as_raw();
    let mode = stat.st_mode & 0o7777;
    let regular =
        rustix::fs::FileType::from_raw_mode(stat.st_mode) == rustix::fs::FileType::RegularFile;
    if !regular || stat.st_uid != me || mode & 0o077 != 0 {
        return Err(format!(
            "--l1-file {}: owned by uid {} with mode {mode:04o}; a pool file must be a \
             regular file of the server's own uid ({me}) with mode 0600, or anyone else \
             who can write it could plant values and who can read it could read every \
             tenant's: remove it (the server makes a new one) or `chown {me} {0} && chmod \
             600 {0}` if it is the server's own",
            path.display(),
            stat.st_uid,
        ));
    }
    if let Ok(fs) = rustix::fs::fstatfs(&fd) {
        const TMPFS_MAGIC: i64 = 0x0102_1994;
        const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
        #[allow(clippy::unnecessary_cast)]
        let kind = fs.f_type as i64;
        if kind != TMPFS_MAGIC && kind != HUGETLBFS_MAGIC {
            tracing::warn!(
                path = %path.display(),
                "--l1-file is not on tmpfs or hugetlbfs: the kernel writes the pool back \
                 to disk as it changes; name a path under /dev/shm or a memory-backed \
                 emptyDir"
            );
        }
    }
    Ok(fd)
}

impl Seals {
    /// The index in `fd` (its header already written), mapped.
    fn map(fd: OwnedFd, geometry: Geometry, key: SealKey) -> Result<Seals, String> {
        let len = usize::try_from(geometry.index_bytes()).map_err(|e| e.to_string())?;
        let index =
            SharedMapping::map(&fd, len).map_err(|e| format!("mapping the L1 index: {e}"))?;
        Ok(Seals {
            index,
            _fd: fd,
            key,
            geometry,
        })
    }

    /// Seals `len` bytes of `key` in `slot` (committed, pinned while this runs); a key
    /// too long for a seal leaves the slot unsealed (not adopted after a restart).
    pub fn seal(&self, pool: &Arc<SharedMapping>, slot: usize, key: &[u8], len: u64) -> bool {
        let slot = slot as u64;
        let Ok(len_usize) = usize::try_from(len) else {
            return false;
        };
        let Some(payload) = SlotBytes::new(pool, slot * self.geometry.slot_bytes, len_usize) else {
            return false;
        };
        let at = self.geometry.seal_offset(slot);
        match seal::seal(&self.key, self.geometry, slot, key, payload.as_ref()) {
            Some(sealed) => self.index.write(at, &sealed),
            None => {
                // A blank seal: whatever this slot held before is not adopted.
                self.index.write(at, &[0u8; SEAL_BYTES]);
                false
            }
        }
    }

    /// Checks the seals of `count` slots from `first` on. Each value is copied out
    /// before it is checked: a store may take an unscanned slot and write it meanwhile
    /// (its finding is then ignored by the node), so the pool is never borrowed here.
    pub fn scan(&self, pool: &Arc<SharedMapping>, first: usize, count: usize) -> Vec<Scanned> {
        let mut payload = Vec::new();
        (first..first + count)
            .map(|slot| {
                let slot = slot as u64;
                let mut head = [0u8; SEAL_BYTES];
                if !self.index.read(self.geometry.seal_offset(slot), &mut head) {
                    return Scanned::Blank;
                }
                let len = match seal::claimed_len(&head, self.geometry) {
                    None => return Scanned::Blank,
                    Some(Err(why)) => return Scanned::Unsealed(why),
                    Some(Ok(len)) => len as usize,
                };
                payload.resize(len, 0);
                if !pool.read(slot * self.geometry.slot_bytes, &mut payload) {
                    return Scanned::Unsealed(seal::Unsealed::Malformed);
                }
                match seal::open(&self.key, self.geometry, slot, &head, &payload) {
                    Ok((key, len)) => Scanned::Sealed { key, len },
                    Err(why) => Scanned::Unsealed(why),
                }
            })
            .collect()
    }
}

/// A view of `len` bytes of the pool at an offset, for an L2 thread to send a published
/// slot without copying it first. It keeps the mapping alive; the node keeps the slot
/// pinned (published, so nothing writes it) until the write ends, and the view is
/// dropped by then. A worker that wrote into a published slot anyway (the protocol
/// forbids it) could make the bytes sent differ from the bytes checksummed: readers
/// then find the value corrupt, a miss (row 28), never wrong data.
pub struct SlotBytes {
    _mapping: Arc<SharedMapping>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is into `_mapping`, which is `Send + Sync` and kept alive here; the
// view only reads.
unsafe impl Send for SlotBytes {}

impl SlotBytes {
    /// `[offset, offset + len)` of `mapping`, or None when out of bounds.
    pub fn new(mapping: &Arc<SharedMapping>, offset: u64, len: usize) -> Option<SlotBytes> {
        let ptr = mapping.range_ptr(offset, len as u64)?;
        Some(SlotBytes {
            _mapping: Arc::clone(mapping),
            ptr: ptr.cast_const(),
            len,
        })
    }
}

impl AsRef<[u8]> for SlotBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `new` checked that the range lies inside the mapping, which lives as
        // long as `self`; the slot is pinned, so nothing in this process writes it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_view_reads_what_the_pool_holds_and_refuses_out_of_bounds() {
        let l1 = L1::new(4 * 4096, 4096, false).unwrap();
        assert!(l1.mapping().write(l1.offset(2), b"published"));
        let view = SlotBytes::new(l1.mapping(), l1.offset(2), 9).unwrap();
        assert_eq!(view.as_ref(), b"published");
        assert!(SlotBytes::new(l1.mapping(), l1.offset(3), 4097).is_none());
        drop(l1);
        assert_eq!(
            view.as_ref(),
            b"published",
            "the view keeps the mapping alive"
        );
    }

    #[test]
    fn the_pool_memfd_cannot_be_resized_by_whoever_holds_it() {
        let l1 = L1::new(2 * 4096, 4096, true).unwrap();
        let seals = rustix::fs::fcntl_get_seals(l1.pool_fd()).unwrap();
        assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL));
        assert!(rustix::fs::ftruncate(l1.pool_fd(), 4096).is_err());
        assert!(rustix::fs::ftruncate(l1.pool_fd(), 4 * 4096).is_err());
    }
}
