//! The deadline thread: answers every read that the L2 threads have not answered by its
//! deadline, so that no caller ever waits longer than the L2 timeout, whatever Redis
//! (or redis-rs) does.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// A read waiting for its deadline.
struct Entry<T> {
    at: Instant,
    seq: u64,
    item: Arc<T>,
}

impl<T> PartialEq for Entry<T> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl<T> Eq for Entry<T> {}
impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<T> Ord for Entry<T> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

struct Table<T> {
    heap: BinaryHeap<Reverse<Entry<T>>>,
    next_seq: u64,
    shutdown: bool,
}

/// Deadlines of items of type `T`, fired on a thread of their own.
pub(super) struct Deadlines<T> {
    table: Mutex<Table<T>>,
    changed: Condvar,
}

impl<T: Send + Sync + 'static> Deadlines<T> {
    pub(super) fn new() -> Deadlines<T> {
        Deadlines {
            table: Mutex::new(Table {
                heap: BinaryHeap::new(),
                next_seq: 0,
                shutdown: false,
            }),
            changed: Condvar::new(),
        }
    }

    /// Fires `item` at `at` (the fire function decides whether it still matters).
    pub(super) fn add(&self, at: Instant, item: Arc<T>) {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let seq = table.next_seq;
        table.next_seq = table.next_seq.wrapping_add(1);
        let earliest = table.heap.peek().is_none_or(|Reverse(top)| at < top.at);
        table.heap.push(Reverse(Entry { at, seq, item }));
        drop(table);
        if earliest {
            self.changed.notify_one();
        }
    }

    /// Stops the thread at its next turn.
    pub(super) fn shut_down(&self) {
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .shutdown = true;
        self.changed.notify_one();
    }

    /// The thread's body: fires each deadline once, in order, until shut down.
    pub(super) fn run(&self, fire: impl Fn(&T)) {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if table.shutdown {
                return;
            }
            let now = Instant::now();
            match table.heap.peek() {
                Some(Reverse(top)) if top.at <= now => {
                    let Some(Reverse(entry)) = table.heap.pop() else {
                        continue;
                    };
                    drop(table);
                    fire(&entry.item);
                    table = self.table.lock().unwrap_or_else(|e| e.into_inner());
                }
                Some(Reverse(top)) => {
                    let wait = top.at - now;
                    table = self
                        .changed
                        .wait_timeout(table, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                None => {
                    table = self.changed.wait(table).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }
}
