//! What the node keeps of each registered entry besides its liveness: the details its
//! REGISTER gave (owner, tenant, model), the builds in flight, the processes whose exit
//! proves an instance's, and the frees the shell runs with their watchdog.

use super::builds::Builds;
use super::frees::Frees;
use super::watches::Watches;
use super::{EntryDetails, InstanceId, Module};
use std::collections::BTreeMap;

/// The registered entries' bookkeeping, each part an owner of its own rules.
#[derive(Default)]
pub(super) struct Registry {
    /// Owner, tenant, registration time and model of each entry.
    pub(super) records: BTreeMap<(InstanceId, Module), EntryDetails>,
    /// Builds in flight and the REGISTERs waiting for them.
    pub(super) builds: Builds,
    /// Which process proves each instance's exit.
    pub(super) watches: Watches,
    /// Frees the shell runs, their watchdog, the counts of frees started.
    pub(super) frees: Frees,
}
