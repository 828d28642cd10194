//! The context pool: builds, frees and copies run here, never on the event loop, and
//! report back through a `mio::Waker`.
//!
//! Builds and copies share a small fixed set of threads. Frees get a thread each: a
//! free may hang (a CUDA call that never returns) and must never hold up another free
//! or a build; the event loop's watchdog reports the ones that take too long.
//!
//! Every job reports back, even when it panics ([`guarded`]): the node waits for each
//! build, copy, blend and free it asked for, so a job that vanished would leak its
//! context (and hold its connection's in-flight count) for good.

use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Task<T> = Box<dyn FnOnce() -> T + Send + 'static>;

/// Results handed back to the event loop.
pub struct Completions<T> {
    queue: Mutex<VecDeque<T>>,
    waker: Arc<mio::Waker>,
}

impl<T> Completions<T> {
    fn push(&self, item: T) {
        // A poisoned lock only means another pool thread panicked mid-push; the queue
        // itself is still consistent.
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        queue.push_back(item);
        drop(queue);
        if let Err(error) = self.waker.wake() {
            tracing::error!(%error, "waking the event loop failed");
        }
    }

    /// Takes every result that arrived.
    pub fn drain(&self) -> VecDeque<T> {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *queue)
    }
}

/// The pool.
pub struct Pool<T: Send + 'static> {
    sender: Option<Sender<Task<T>>>,
    threads: Vec<JoinHandle<()>>,
    completions: Arc<Completions<T>>,
}

impl<T: Send + 'static> Pool<T> {
    /// `threads` workers for builds and copies.
    /// `waker` may be shared with other reporters (mio allows one waker per poll).
    pub fn new(threads: usize, waker: impl Into<Arc<mio::Waker>>) -> std::io::Result<Pool<T>> {
        let waker = waker.into();
        let completions = Arc::new(Completions {
            queue: Mutex::new(VecDeque::new()),
            waker,
        });
        let (sender, receiver) = mpsc::channel::<Task<T>>();
        let receiver = Arc::new(Mutex::new(receiver));
        let mut handles = Vec::with_capacity(threads);
        for index in 0..threads.max(1) {
            let receiver: Arc<Mutex<Receiver<Task<T>>>> = Arc::clone(&receiver);
            let completions = Arc::clone(&completions);
            let handle = std::thread::Builder::new()
                .name(format!("kvwarden-pool-{index}"))
                .spawn(move || {
                    loop {
                        let task = {
                            let receiver = receiver.lock().unwrap_or_else(|e| e.into_inner());
                            receiver.recv()
                        };
                        match task {
                            Ok(task) => completions.push(task()),
                            Err(_) => return, // the pool was dropped
                        }
                    }
                })?;
            handles.push(handle);
        }
        Ok(Pool {
            sender: Some(sender),
            threads: handles,
            completions,
        })
    }

    /// Runs `task` on a pool thread; its result comes back through `completions`
    /// (`on_panic`'s, with the panic's message, if `task` panics).
    pub fn submit(
        &self,
        task: impl FnOnce() -> T + Send + 'static,
        on_panic: impl FnOnce(String) -> T + Send + 'static,
    ) {
        if let Some(sender) = &self.sender
            && sender
                .send(Box::new(move || guarded(task, on_panic)))
                .is_err()
        {
            tracing::error!("the context pool is gone; a task was dropped");
        }
    }

    /// Runs `task` on a thread of its own (frees: one hung free never blocks another);
    /// `on_panic` as for [`Pool::submit`].
    pub fn submit_detached(
        &self,
        name: &str,
        task: impl FnOnce() -> T + Send + 'static,
        on_panic: impl FnOnce(String) -> T + Send + 'static,
    ) {
        let completions = Arc::clone(&self.completions);
        let spawned = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || completions.push(guarded(task, on_panic)));
        if let Err(error) = spawned {
            tracing::error!(%error, "spawning a free thread failed; the context leaks");
        }
    }

    /// The results queue.
    pub fn completions(&self) -> &Completions<T> {
        &self.completions
    }
}

impl<T: Send + 'static> Drop for Pool<T> {
    fn drop(&mut self) {
        self.sender = None;
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
    }
}

/// Runs `task`; if it panics, logs the panic and returns `on_panic(message)` instead,
/// so that whoever waits for the result always gets one.
pub fn guarded<T>(task: impl FnOnce() -> T, on_panic: impl FnOnce(String) -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(task)) {
        Ok(result) => result,
        Err(payload) => {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_string());
            tracing::error!(panic = %message, "a pool job panicked; its result is reported as an error");
            on_panic(message)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_job_still_reports_back() {
        assert_eq!(guarded(|| 7, |_| 0), 7);
        let reported = guarded(|| -> Result<u32, String> { panic!("boom") }, Err);
        assert_eq!(reported, Err("boom".to_string()));

        let poll = mio::Poll::new().unwrap();
        let waker = mio::Waker::new(poll.registry(), mio::Token(0)).unwrap();
        let pool: Pool<Result<u32, String>> = Pool::new(1, waker).unwrap();
        pool.submit(|| panic!("in the pool"), Err);
        pool.submit(|| Ok(2), Err);
        pool.submit_detached("test-free", || panic!("detached {}", 3), Err);
        let mut results = Vec::new();
        while results.len() < 3 {
            results.extend(pool.completions().drain());
            std::thread::yield_now();
        }
        results.sort();
        assert_eq!(
            results,
            vec![
                Ok(2),
                Err("detached 3".to_string()),
                Err("in the pool".to_string())
            ]
        );
    }
}
