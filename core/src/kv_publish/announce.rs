//! The server's own announcer for one tenant's stream (`kvwarden serve --kv-events`):
//! which blocks a router may send that tenant's requests here for.
//!
//! A block is announced once its description is known (attached to its first shard by
//! `describe_keys`: version 3 names every shard's key), every one of its shards is held
//! (in L1 or L2), and its parent's hash is announced: a block loads only with its whole
//! prefix.
//! It is withdrawn, with every block after it, as soon as that stops being true;
//! parents' events come before their children's. What it remembers is bounded
//! ([`MAX_BLOCKS`] descriptions, [`MAX_SHARDS`] shards held): a block whose description
//! is forgotten is withdrawn.
//!
//! A stream speaks of hashes: two blocks of one hash (the same tokens under two models
//! or layouts of the tenant) are one announcement, made when the first becomes
//! loadable and withdrawn when the last stops being so.

use super::meta::{BlockHash, BlockMeta};
use super::recency::Recency;
use crate::protocol::KvTier;
use std::sync::Arc;

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// Blocks whose description is kept, oldest first out.
pub const MAX_BLOCKS: usize = 65_536;
/// Shards whose presence is kept, oldest first out.
pub const MAX_SHARDS: usize = 262_144;

/// One event of a tenant's stream, in the order a router must apply them.
#[derive(Clone, Debug, PartialEq)]
pub enum BlockEvent {
    /// The block may be loaded here now.
    Stored(Arc<BlockMeta>),
    /// It may not any more.
    Removed(BlockHash),
    /// Forget everything this stream announced before (its first event, and after a
    /// gap the stream could not fill).
    AllCleared,
}

/// One tenant's announcer. See the module docs.
#[derive(Default)]
pub struct Announcer {
    /// Descriptions by block (its chain key), the least recently described first out.
    meta: Recency<Arc<BlockMeta>>,
    /// The blocks whose parent has a hash.
    children: HashMap<BlockHash, HashSet<Vec<u8>>>,
    /// The block each known shard key belongs to.
    block_of: HashMap<Vec<u8>, Vec<u8>>,
    /// Shard keys held, and in which tiers, oldest change first.
    present: Recency<TierSet>,
    announced: HashSet<Vec<u8>>,
    /// Blocks announced by hash.
    by_announced_hash: HashMap<BlockHash, usize>,
    out: Vec<BlockEvent>,
}

/// The tiers a shard is held in.
#[derive(Copy, Clone, Default, Debug)]
struct TierSet {
    l1: bool,
    l2: bool,
}

impl TierSet {
    fn set(&mut self, tier: KvTier, held: bool) {
        match tier {
            KvTier::L1 => self.l1 = held,
            KvTier::L2 => self.l2 = held,
        }
    }

    fn any(self) -> bool {
        self.l1 || self.l2
    }
}

impl Announcer {
    /// An announcer that has announced nothing.
    pub fn new() -> Announcer {
        Announcer::default()
    }

    /// Blocks announced now.
    pub fn announced(&self) -> usize {
        self.announced.len()
    }

    /// The events made since the last call, oldest first.
    pub fn take(&mut self) -> Vec<BlockEvent> {
        std::mem::take(&mut self.out)
    }

    /// Shard `key` (the tenant's key, without its prefix) entered `tier` (`stored`) or
    /// left it.
    pub fn change(&mut self, key: &[u8], stored: bool, tier: KvTier) {
        if stored {
            self.present.touch(key, TierSet::default).set(tier, true);
        } else if let Some(tiers) = self.present.get_mut(key) {
            tiers.set(tier, false);
            if !tiers.any() {
                self.present.remove(key);
            }
        }
        if let Some(block) = self.block_of.get(key).cloned() {
            self.settle(&block);
        }
        while self.present.len() > MAX_SHARDS {
            if let Some((gone, _)) = self.present.pop_oldest()
                && let Some(block) = self.block_of.get(&gone).cloned()
            {
                self.settle(&block);
            }
        }
    }

    /// The description of the block whose first shard is `key` arrived: announces it if
    /// it is loadable. A description that names another first shard is ignored.
    pub fn describe(&mut self, key: &[u8], meta: BlockMeta) {
        if meta.shard_keys.first().map(Vec::as_slice) != Some(key) {
            return;
        }
        let chain = meta.chain_key.clone();
        if self.meta.contains(&chain) {
            self.meta.touch(&chain, || unreachable!("held"));
            return;
        }
        if let Some(parent) = &meta.parent_hash {
            self.children
                .entry(parent.clone())
                .or_default()
                .insert(chain.clone());
        }
        for shard in &meta.shard_keys {
            self.block_of.insert(shard.clone(), chain.clone());
        }
        let meta = Arc::new(meta);
        self.meta.touch(&chain, || meta);
        while self.meta.len() > MAX_BLOCKS {
            match self.meta.pop_oldest() {
                Some((oldest, meta)) => self.forget(&oldest, &meta),
                None => break,
            }
        }
        self.settle(&chain);
    }

    /// Known, every shard held, and its parent (if any) announced.
    fn loadable(&self, chain: &[u8]) -> bool {
        let Some(meta) = self.meta.get(chain) else {
            return false;
        };
        if !meta
            .shard_keys
            .iter()
            .all(|shard| self.present.contains(shard))
        {
            return false;
        }
        match &meta.parent_hash {
            None => true,
            Some(parent) => self.by_announced_hash.contains_key(parent),
        }
    }

    /// Announces or withdraws the block as it is loadable or not, then the blocks after
    /// it.
    fn settle(&mut self, chain: &[u8]) {
        let mut todo = vec![chain.to_vec()];
        while let Some(block) = todo.pop() {
            let loadable = self.loadable(&block);
            if loadable == self.announced.contains(&block) {
                continue;
            }
            let Some(meta) = self.meta.get(&block).cloned() else {
                self.announced.remove(&block);
                continue;
            };
            if loadable {
                self.announced.insert(block);
                self.told_stored(&meta);
            } else {
                self.announced.remove(&block);
                self.told_removed(&meta.block_hash);
            }
            if let Some(children) = self.children.get(&meta.block_hash) {
                todo.extend(children.iter().cloned());
            }
        }
    }

    /// A block is announced: its hash is, unless another block of it was already.
    fn told_stored(&mut self, meta: &Arc<BlockMeta>) {
        let count = self
            .by_announced_hash
            .entry(meta.block_hash.clone())
            .or_default();
        *count += 1;
        if *count == 1 {
            self.out.push(BlockEvent::Stored(meta.clone()));
        }
    }

    /// A block is withdrawn: its hash is, once no other block of it is announced.
    fn told_removed(&mut self, hash: &BlockHash) {
        if let Some(count) = self.by_announced_hash.get_mut(hash) {
            *count -= 1;
            if *count == 0 {
                self.by_announced_hash.remove(hash);
                self.out.push(BlockEvent::Removed(hash.clone()));
            }
        }
    }

    /// Drops a block's description: withdrawn if announced (its removal could not be
    /// told later), and the blocks after it with it.
    fn forget(&mut self, chain: &[u8], meta: &BlockMeta) {
        for shard in &meta.shard_keys {
            if self.block_of.get(shard).map(Vec::as_slice) == Some(chain) {
                self.block_of.remove(shard);
            }
        }
        if let Some(parent) = &meta.parent_hash
            && let Some(siblings) = self.children.get_mut(parent)
        {
            siblings.remove(chain);
            if siblings.is_empty() {
                self.children.remove(parent);
            }
        }
        if self.announced.remove(chain) {
            self.told_removed(&meta.block_hash);
            let children: Vec<Vec<u8>> = self
                .children
                .get(&meta.block_hash)
                .map(|c| c.iter().cloned().collect())
                .unwrap_or_default();
            for child in children {
                self.settle(&child);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block `name` of two shards (`name/0`, `name/1`), child of `parent`.
    fn block(name: &str, parent: Option<&str>) -> BlockMeta {
        BlockMeta {
            chain_key: name.as_bytes().to_vec(),
            block_hash: BlockHash::Bytes(format!("h-{name}").into_bytes()),
            parent_hash: parent.map(|p| BlockHash::Bytes(format!("h-{p}").into_bytes())),
            token_ids: vec![1, 2, 3, 4],
            extra_keys: rmpv::Value::Nil,
            lora: None,
            shard_keys: vec![shard(name, 0), shard(name, 1)],
        }
    }

    fn shard(name: &str, rank: u8) -> Vec<u8> {
        format!("{name}/{rank}").into_bytes()
    }

    /// The events since the last call, as `+name` / `-name`.
    fn told(a: &mut Announcer) -> Vec<String> {
        a.take()
            .into_iter()
            .map(|e| match e {
                BlockEvent::Stored(m) => format!("+{}", String::from_utf8_lossy(&m.chain_key)),
                BlockEvent::Removed(BlockHash::Bytes(h)) => {
                    format!("-{}", String::from_utf8_lossy(&h[2..]))
                }
                other => format!("{other:?}"),
            })
            .collect()
    }

    fn hold(a: &mut Announcer, name: &str) {
        a.change(&shard(name, 0), true, KvTier::L1);
        a.change(&shard(name, 1), true, KvTier::L1);
    }

    #[test]
    fn a_block_is_announced_once_described_and_every_shard_held_and_withdrawn_when_one_leaves() {
        let mut a = Announcer::new();
        a.change(&shard("a", 0), true, KvTier::L1);
        a.describe(&shard("a", 0), block("a", None));
        assert_eq!(told(&mut a), Vec::<String>::new(), "one shard of two held");
        a.change(&shard("a", 1), true, KvTier::L2);
        assert_eq!(told(&mut a), ["+a"]);
        // Leaving L1 while L2 holds it changes nothing; leaving both withdraws it.
        a.change(&shard("a", 1), true, KvTier::L1);
        a.change(&shard("a", 1), false, KvTier::L2);
        assert_eq!(told(&mut a), Vec::<String>::new());
        a.change(&shard("a", 1), false, KvTier::L1);
        assert_eq!(told(&mut a), ["-a"]);
        assert_eq!(a.announced(), 0);
    }

    #[test]
    fn a_block_whose_parent_leaves_is_withdrawn_with_every_block_after_it() {
        let mut a = Announcer::new();
        for (name, parent) in [("a", None), ("b", Some("a")), ("c", Some("b"))] {
            hold(&mut a, name);
            a.describe(&shard(name, 0), block(name, parent));
        }
        assert_eq!(told(&mut a), ["+a", "+b", "+c"]);
        a.change(&shard("a", 0), false, KvTier::L1);
        assert_eq!(told(&mut a), ["-a", "-b", "-c"], "parents' events first");
        hold(&mut a, "a");
        assert_eq!(told(&mut a), ["+a", "+b", "+c"]);
        // A child described before its parent waits for it.
        let mut late = Announcer::new();
        hold(&mut late, "a");
        hold(&mut late, "b");
        late.describe(&shard("b", 0), block("b", Some("a")));
        assert_eq!(told(&mut late), Vec::<String>::new());
        late.describe(&shard("a", 0), block("a", None));
        assert_eq!(told(&mut late), ["+a", "+b"]);
    }

    #[test]
    fn two_blocks_of_one_hash_are_one_announcement_until_the_last_leaves() {
        let mut a = Announcer::new();
        let twin = |name: &str| BlockMeta {
            block_hash: BlockHash::Bytes(b"h-same".to_vec()),
            ..block(name, None)
        };
        hold(&mut a, "x");
        a.describe(&shard("x", 0), twin("x"));
        hold(&mut a, "y");
        a.describe(&shard("y", 0), twin("y"));
        assert_eq!(
            told(&mut a),
            ["+x"],
            "the second block of the hash says nothing"
        );
        a.change(&shard("x", 0), false, KvTier::L1);
        assert_eq!(told(&mut a), Vec::<String>::new(), "y still holds the hash");
        a.change(&shard("y", 1), false, KvTier::L1);
        assert_eq!(told(&mut a), ["-same"]);
    }

    #[test]
    fn a_description_that_names_another_first_shard_is_ignored() {
        let mut a = Announcer::new();
        hold(&mut a, "a");
        // Control: attached to its first shard, it is announced.
        let mut control = Announcer::new();
        hold(&mut control, "a");
        control.describe(&shard("a", 0), block("a", None));
        assert_eq!(told(&mut control), ["+a"]);
        a.describe(&shard("a", 1), block("a", None));
        a.describe(b"someone else's key", block("a", None));
        assert_eq!(told(&mut a), Vec::<String>::new());
    }

    #[test]
    fn a_block_whose_description_is_forgotten_is_withdrawn_with_its_children() {
        let mut a = Announcer::new();
        hold(&mut a, "a");
        a.describe(&shard("a", 0), block("a", None));
        hold(&mut a, "b");
        a.describe(&shard("b", 0), block("b", Some("a")));
        assert_eq!(told(&mut a), ["+a", "+b"]);
        let meta = a.meta.remove(b"a").unwrap();
        a.forget(b"a", &meta);
        assert_eq!(told(&mut a), ["-a", "-b"]);
        // Bounded: past MAX_BLOCKS descriptions the oldest goes.
        let mut many = Announcer::new();
        for n in 0..=MAX_BLOCKS {
            many.describe(&shard(&n.to_string(), 0), block(&n.to_string(), None));
        }
        assert_eq!(many.meta.len(), MAX_BLOCKS);
        assert!(!many.meta.contains(b"0"));
    }
}
