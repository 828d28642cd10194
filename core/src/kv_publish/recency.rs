//! A map that forgets its least recently touched entry first, in O(1) a touch: each
//! touch queues the key with a new generation, and the queue's stale entries (an older
//! generation, or a key removed) are skipped when the oldest is taken, and dropped
//! whenever they outnumber the live ones.

use std::collections::VecDeque;

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// See the module docs.
pub struct Recency<V> {
    map: HashMap<Vec<u8>, (V, u64)>,
    order: VecDeque<(Vec<u8>, u64)>,
    next: u64,
}

impl<V> Default for Recency<V> {
    fn default() -> Self {
        Recency {
            map: HashMap::default(),
            order: VecDeque::new(),
            next: 0,
        }
    }
}

impl<V> Recency<V> {
    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// The value of `key`.
    pub fn get(&self, key: &[u8]) -> Option<&V> {
        self.map.get(key).map(|(value, _)| value)
    }

    /// The value of `key`, to change.
    pub fn get_mut(&mut self, key: &[u8]) -> Option<&mut V> {
        self.map.get_mut(key).map(|(value, _)| value)
    }

    /// Whether `key` is held.
    pub fn contains(&self, key: &[u8]) -> bool {
        self.map.contains_key(key)
    }

    /// Makes `key` the most recent, inserting `make()` if it is not held; its value.
    pub fn touch(&mut self, key: &[u8], make: impl FnOnce() -> V) -> &mut V {
        self.next += 1;
        let generation = self.next;
        self.order.push_back((key.to_vec(), generation));
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order
                .retain(|(k, g)| map.get(k).is_some_and(|(_, live)| live == g) || *g == generation);
        }
        if !self.map.contains_key(key) {
            self.map.insert(key.to_vec(), (make(), generation));
        }
        let entry = self.map.get_mut(key).expect("inserted above");
        entry.1 = generation;
        &mut entry.0
    }

    /// Removes `key`; its value.
    pub fn remove(&mut self, key: &[u8]) -> Option<V> {
        self.map.remove(key).map(|(value, _)| value)
    }

    /// Removes the least recently touched entry.
    pub fn pop_oldest(&mut self) -> Option<(Vec<u8>, V)> {
        while let Some((key, generation)) = self.order.pop_front() {
            if self
                .map
                .get(&key)
                .is_some_and(|(_, live)| *live == generation)
            {
                let (value, _) = self.map.remove(&key)?;
                return Some((key, value));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_touched_goes_first_and_stale_entries_stay_bounded() {
        let mut r: Recency<u32> = Recency::default();
        *r.touch(b"a", || 1) += 0;
        r.touch(b"b", || 2);
        r.touch(b"c", || 3);
        r.touch(b"a", || 9); // a is recent again, its value kept
        assert_eq!(r.get(b"a"), Some(&1));
        r.remove(b"c");
        assert_eq!(r.pop_oldest(), Some((b"b".to_vec(), 2)));
        assert_eq!(r.pop_oldest(), Some((b"a".to_vec(), 1)));
        assert_eq!(r.pop_oldest(), None);
        for n in 0..10_000u32 {
            r.touch(b"same", || n);
        }
        assert!(
            r.order.len() <= 2 * r.len() + 65,
            "{} queued",
            r.order.len()
        );
        assert_eq!(r.len(), 1);
    }
}
