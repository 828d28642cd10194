//! Process watches: which process is each instance's proof of exit (the newest
//! registrant's), with one watch per process however many instances it holds. The
//! node turns a change into `PeerAction::Watch` / `Unwatch` for the shell.

use super::{BTreeSet, DeathNotice, HashMap, InstanceId, ProcessKey};

/// Every instance's watched process, and every watched process's instances.
#[derive(Default)]
pub(super) struct Watches {
    instances: HashMap<ProcessKey, BTreeSet<InstanceId>>,
    process_of: HashMap<InstanceId, (ProcessKey, DeathNotice)>,
}

/// What a [`Watches::watch`] asks of the shell.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct WatchChange {
    /// Stop watching this process: its last instance moved to another.
    pub(super) stop: Option<ProcessKey>,
    /// Start watching the new process: it holds its first instance.
    pub(super) start: bool,
}

impl Watches {
    /// `process` (noticed as `notice`) is now the proof of exit of `instance`.
    pub(super) fn watch(
        &mut self,
        instance: InstanceId,
        process: ProcessKey,
        notice: DeathNotice,
    ) -> WatchChange {
        let mut change = WatchChange::default();
        if let Some(&(previous, _)) = self.process_of.get(&instance) {
            if previous == process {
                self.process_of.insert(instance, (process, notice));
                return change;
            }
            change.stop = self.unwatch(instance);
        }
        let instances = self.instances.entry(process).or_default();
        change.start = instances.is_empty();
        instances.insert(instance);
        self.process_of.insert(instance, (process, notice));
        change
    }

    /// `instance` is watched no more; Some(process) when that was its process's last
    /// instance (stop watching it).
    pub(super) fn unwatch(&mut self, instance: InstanceId) -> Option<ProcessKey> {
        let (process, _) = self.process_of.remove(&instance)?;
        let instances = self.instances.get_mut(&process)?;
        instances.remove(&instance);
        if !instances.is_empty() {
            return None;
        }
        self.instances.remove(&process);
        Some(process)
    }

    /// `process` exited: the instances it was the proof of, watched no more.
    pub(super) fn exited(&mut self, process: ProcessKey) -> BTreeSet<InstanceId> {
        let instances = self.instances.remove(&process).unwrap_or_default();
        for instance in &instances {
            self.process_of.remove(instance);
        }
        instances
    }

    /// The process watched for `instance`, and how its death will be noticed.
    pub(super) fn of(&self, instance: InstanceId) -> Option<(ProcessKey, DeathNotice)> {
        self.process_of.get(&instance).copied()
    }

    /// Processes watched.
    pub(super) fn processes(&self) -> usize {
        self.instances.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u64) -> InstanceId {
        InstanceId::new(n).unwrap()
    }

    #[test]
    fn one_watch_per_process_started_with_its_first_instance_and_stopped_with_its_last() {
        let mut watches = Watches::default();
        let (a, b) = (ProcessKey(1), ProcessKey(2));
        let notice = DeathNotice::PidfdByPid;
        assert!(watches.watch(id(1), a, notice).start);
        assert_eq!(watches.watch(id(2), a, notice), WatchChange::default());
        assert_eq!(watches.processes(), 1);
        // Instance 1 re-registered by another process: a keeps instance 2.
        let moved = watches.watch(id(1), b, notice);
        assert_eq!((moved.stop, moved.start), (None, true));
        assert_eq!(watches.of(id(1)), Some((b, notice)));
        // Its last instance gone, a is watched no more; b's exit frees instance 1 only.
        assert_eq!(watches.unwatch(id(2)), Some(a));
        assert_eq!(watches.unwatch(id(2)), None);
        assert_eq!(watches.exited(b), BTreeSet::from([id(1)]));
        assert_eq!((watches.processes(), watches.of(id(1))), (0, None));
    }
}
