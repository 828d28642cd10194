//! The deadline thread: answers every read that the L2 threads have not answered by its
//! deadline, so that no caller ever waits longer than the L2 timeout, whatever Redis
//! (or redis-rs) does.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How late the thread may wake for a deadline, so that one wake-up fires every
/// deadline that fell due meanwhile. Without it the thread woke once per read (each
/// read's deadline is still in the heap after the read was answered: thousands of
/// wake-ups a second under load, for nothing). Never early: a deadline fires at or after
/// its time. The node keeps its own deadlines, so a caller is answered on time anyway.
pub(super) const WAKE_SLACK: Duration = Duration::from_millis(2);

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
                    let wait = top.at - now + WAKE_SLACK;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn every_deadline_fires_once_in_order_and_never_before_its_time() {
        let deadlines = Arc::new(Deadlines::<(u32, Instant)>::new());
        let (fired, fired_rx) = mpsc::channel();
        let runner = {
            let deadlines = Arc::clone(&deadlines);
            std::thread::spawn(move || {
                deadlines.run(|(n, at)| {
                    let _ = fired.send((*n, Instant::now() >= *at));
                })
            })
        };
        let start = Instant::now();
        // Close together (many fall due within one slack) and out of order.
        for n in (0..64u32).rev() {
            let at = start + Duration::from_micros(200 * u64::from(n));
            deadlines.add(at, Arc::new((n, at)));
        }
        let mut seen = Vec::new();
        for _ in 0..64 {
            let (n, on_time) = fired_rx
                .recv_timeout(Duration::from_secs(30))
                .expect("every deadline fires");
            assert!(on_time, "deadline {n} fired before its time");
            seen.push(n);
        }
        assert_eq!(
            seen,
            (0..64).collect::<Vec<_>>(),
            "once each, in deadline order"
        );
        deadlines.shut_down();
        runner.join().unwrap();
        assert!(fired_rx.try_recv().is_err(), "nothing fired twice");
    }
}
