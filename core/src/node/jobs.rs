//! The pool's queue (failure mode 68): copies wait here, one queue per tenant, and go
//! to the shell's pool in turns by tenant, at most `window` jobs running at a time.
//! Builds and blends go at once (counted in the window): a tenant's are few, bounded
//! by its mapped bytes and its share of the rope tables, and a `register` is answered
//! by its build, so it should not queue behind copies. Frees never wait: they have
//! threads of their own.
//!
//! The shell's pool is a FIFO. Handed every job at once, it served one tenant's 64
//! batches of 1,024 copies before another tenant's single `retrieve` (43 s against about
//! 1 ms at rest). Here a tenant with work waiting is served one job per turn, so a job
//! waits for at most one job of each other tenant with work waiting, after the window
//! already handed out (twice the pool's threads: each thread always finds its next job
//! without a turn of the loop in between).

use super::Job;
use super::trust::TenantId;
use std::collections::VecDeque;

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Jobs handed to the pool at once when the shell names no bound (the node's tests
/// and those of the simulator's runs that model an unbounded pool).
pub const UNBOUNDED: usize = usize::MAX;

/// The queue: one FIFO per tenant, the tenants with a job waiting in turn order.
pub(super) struct JobQueue {
    window: usize,
    running: usize,
    queues: HashMap<TenantId, VecDeque<Job>>,
    /// Tenants with a job waiting, the next to be served first.
    turns: VecDeque<TenantId>,
    waiting: usize,
    handed_out: u64,
}

impl JobQueue {
    /// A queue handing out at most `window` jobs at once (at least one).
    pub(super) fn new(window: usize) -> JobQueue {
        JobQueue {
            window: window.max(1),
            running: 0,
            queues: HashMap::default(),
            turns: VecDeque::new(),
            waiting: 0,
            handed_out: 0,
        }
    }

    /// `tenant`'s `job` waits for its turn.
    pub(super) fn push(&mut self, tenant: TenantId, job: Job) {
        let queue = self.queues.entry(tenant).or_default();
        if queue.is_empty() {
            self.turns.push_back(tenant);
        }
        queue.push_back(job);
        self.waiting += 1;
    }

    /// The next job to hand to the pool, if the window has room: the oldest of the
    /// tenant whose turn it is, which then goes to the back of the turns.
    pub(super) fn next(&mut self) -> Option<Job> {
        if self.running >= self.window {
            return None;
        }
        let tenant = self.turns.pop_front()?;
        let queue = self.queues.get_mut(&tenant)?;
        let job = queue.pop_front()?;
        if queue.is_empty() {
            self.queues.remove(&tenant);
        } else {
            self.turns.push_back(tenant);
        }
        self.waiting -= 1;
        self.running += 1;
        self.handed_out += 1;
        Some(job)
    }

    /// A job that goes to the pool at once, ahead of those waiting (a build or a
    /// blend): it counts in the window.
    pub(super) fn now(&mut self, job: Job) -> Job {
        self.running += 1;
        self.handed_out += 1;
        job
    }

    /// A job handed out reported back: the window has room for one more.
    pub(super) fn finished(&mut self) {
        self.running = self.running.saturating_sub(1);
    }

    /// Takes every copy still waiting out of the queue (a shutdown's drain is over:
    /// they will not run). Other jobs keep their turns.
    pub(super) fn take_waiting_copies(&mut self) -> Vec<Job> {
        let mut copies = Vec::new();
        for queue in self.queues.values_mut() {
            let (taken, kept): (VecDeque<Job>, VecDeque<Job>) = std::mem::take(queue)
                .into_iter()
                .partition(|job| matches!(job, Job::Copy { .. }));
            copies.extend(taken);
            *queue = kept;
        }
        self.queues.retain(|_, queue| !queue.is_empty());
        self.turns.retain(|tenant| self.queues.contains_key(tenant));
        self.waiting -= copies.len();
        copies
    }

    /// Whether `tenant` has copies waiting for its turn.
    pub(super) fn has_waiting(&self, tenant: TenantId) -> bool {
        self.queues.contains_key(&tenant)
    }

    /// Jobs waiting for their turn (not yet handed to the pool).
    pub(super) fn waiting(&self) -> usize {
        self.waiting
    }

    /// Jobs handed to the pool at once, at most.
    pub(super) fn window(&self) -> usize {
        self.window
    }

    /// Jobs handed to the pool and not yet reported back.
    pub(super) fn running(&self) -> usize {
        self.running
    }

    /// Jobs handed to the pool so far.
    pub(super) fn handed_out(&self) -> u64 {
        self.handed_out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::InstanceId;
    use crate::node::blend::BlendId;
    use crate::protocol::RopeSpec;

    fn job(n: u64) -> Job {
        Job::Blend {
            blend: BlendId(n),
            instance: InstanceId::new(n + 1).unwrap(),
            spec: RopeSpec {
                rotary_dim: 2,
                max_positions: 1,
                base: 10_000.0,
            },
        }
    }

    fn id(job: Job) -> u64 {
        match job {
            Job::Blend { blend, .. } => blend.0,
            other => panic!("not a test job: {other:?}"),
        }
    }

    #[test]
    fn tenants_take_turns_however_many_jobs_one_has_waiting() {
        let mut queue = JobQueue::new(UNBOUNDED);
        for n in 0..1000 {
            queue.push(TenantId(1), job(n));
        }
        queue.push(TenantId(2), job(5000));
        queue.push(TenantId(3), job(6000));
        queue.push(TenantId(2), job(5001));
        let order: Vec<u64> = std::iter::from_fn(|| queue.next())
            .take(6)
            .map(id)
            .collect();
        assert_eq!(order, vec![0, 5000, 6000, 1, 5001, 2]);
        assert_eq!(queue.waiting(), 1003 - 6);
        assert_eq!(queue.running(), 6);
    }

    #[test]
    fn one_tenant_alone_keeps_its_own_order() {
        let mut queue = JobQueue::new(UNBOUNDED);
        for n in 0..5 {
            queue.push(TenantId(7), job(n));
        }
        let order: Vec<u64> = std::iter::from_fn(|| queue.next()).map(id).collect();
        assert_eq!(order, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn the_window_holds_jobs_back_until_one_reports() {
        let mut queue = JobQueue::new(2);
        for n in 0..3 {
            queue.push(TenantId(1), job(n));
        }
        assert_eq!(queue.next().map(id), Some(0));
        assert_eq!(queue.next().map(id), Some(1));
        assert!(queue.next().is_none(), "two handed out: the window is full");
        queue.push(TenantId(2), job(9));
        assert!(queue.next().is_none());
        queue.finished();
        // Tenant 2 waited one job of tenant 1's thousands, not all of them.
        assert_eq!(queue.next().map(id), Some(2));
        queue.finished();
        assert_eq!(queue.next().map(id), Some(9));
        assert_eq!((queue.waiting(), queue.running()), (0, 2));
        assert!(
            JobQueue::new(0).window == 1,
            "a window of 0 would never run anything"
        );
    }
}
