//! CacheBlend bookkeeping: which instance holds rope tables of which parameters, the
//! computations still wanted, and the limits. The tables themselves (big `f32` arrays)
//! live in the shell, which computes them when the node says `Job::Blend` and keeps,
//! discards or drops them when it says so.

use super::ReplyTo;
use crate::id::InstanceId;
use crate::protocol::{ErrorCode, ProtocolError, RopeSpec};
use std::collections::HashMap;

/// The most bytes one instance's tables (cos and sin together) may take: 256 MiB
/// holds, for example, rotary_dim 128 at 262,144 positions.
pub const MAX_TABLE_BYTES: u64 = 256 << 20;

/// The most bytes every instance's tables (and those being computed) may take
/// together; beyond it `register_blend` is answered `overloaded`. Fitted to the
/// DaemonSet's memory: its limit leaves 2 GiB above the L1 pool (failure mode 47).
pub const MAX_TOTAL_BYTES: u64 = 1 << 30;

/// The most bytes one tenant's instances' tables may take together: three quarters of
/// [`MAX_TOTAL_BYTES`], so that a quarter always stays for the other tenants.
pub const MAX_TENANT_BYTES: u64 = MAX_TOTAL_BYTES - MAX_TOTAL_BYTES / 4;

/// Identifies one computation of rope tables.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlendId(pub u64);

/// Checks the rope parameters; returns the bytes the tables will take, or what was
/// wrong with the value seen and what would be right.
pub fn table_bytes(spec: &RopeSpec) -> Result<u64, String> {
    let RopeSpec {
        rotary_dim,
        max_positions,
        base,
    } = *spec;
    if rotary_dim == 0 || rotary_dim % 2 != 0 {
        return Err(format!(
            "rope.rotary_dim {rotary_dim} must be even and above 0 (RoPE rotates pairs of \
             dimensions), e.g. 64 or 128"
        ));
    }
    if max_positions == 0 {
        return Err("rope.max_positions 0 must be above 0 (the longest context, e.g. 4096)".into());
    }
    if !base.is_finite() || base <= 1.0 {
        return Err(format!(
            "rope.base {base} must be a finite number above 1 (e.g. 10000.0)"
        ));
    }
    let bytes = max_positions
        .checked_mul(rotary_dim)
        .and_then(|values| values.checked_mul(std::mem::size_of::<f32>() as u64))
        .filter(|&bytes| bytes <= MAX_TABLE_BYTES);
    bytes.ok_or_else(|| {
        format!(
            "rope tables for max_positions {max_positions} × rotary_dim {rotary_dim} \
             (cos and sin, f32) exceed the limit of {MAX_TABLE_BYTES} bytes (256 MiB) per \
             instance; lower max_positions or rotary_dim"
        )
    })
}

/// What became of a finished computation.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Finished {
    /// The tables are the instance's now (replacing any it held).
    Installed,
    /// A newer `register_blend` of the instance is computing: these are dropped.
    Superseded,
    /// The instance was freed meanwhile: these are dropped, never held.
    Freed,
}

/// Every instance's rope state, and the computations still wanted.
#[derive(Debug, Default)]
pub struct BlendBook {
    /// instance → (parameters, bytes) of the tables it holds.
    held: HashMap<InstanceId, (RopeSpec, u64)>,
    /// instance → (computation, parameters, bytes) whose result is wanted.
    pending: HashMap<InstanceId, (BlendId, RopeSpec, u64)>,
    held_bytes: u64,
    /// computation → the `register_blend` it answers, and whose.
    waiting: HashMap<BlendId, (ReplyTo, InstanceId)>,
}

/// The tenant of an instance registering rope tables: its name, and which other
/// instances are its.
pub(super) struct BlendTenant<'a> {
    pub(super) name: &'a str,
    pub(super) holds: &'a dyn Fn(InstanceId) -> bool,
}

impl BlendBook {
    /// Whether `bytes` more of rope tables for `instance` fit: within the server's limit
    /// (the instance's own tables are replaced) and, for an instance of a tenant,
    /// within the tenant's share with its other instances' (failure mode 47).
    pub(super) fn admit(
        &self,
        instance: InstanceId,
        bytes: u64,
        tenant: Option<BlendTenant<'_>>,
    ) -> Result<(), ProtocolError> {
        let committed = self
            .committed_bytes()
            .saturating_sub(self.bytes_of(instance));
        if committed.saturating_add(bytes) > MAX_TOTAL_BYTES {
            return Err(ProtocolError::new(
                ErrorCode::Overloaded,
                format!(
                    "`register_blend`: {bytes} more bytes of rope tables would take the server \
                     past its limit of {MAX_TOTAL_BYTES} bytes for all instances ({committed} \
                     held or being computed); retry later"
                ),
            ));
        }
        let Some(tenant) = tenant else {
            return Ok(());
        };
        let tenant_committed =
            self.committed_bytes_of(|other| other != instance && (tenant.holds)(other));
        if tenant_committed.saturating_add(bytes) > MAX_TENANT_BYTES {
            return Err(ProtocolError::new(
                ErrorCode::Overloaded,
                format!(
                    "`register_blend`: {bytes} more bytes of rope tables would take tenant \
                     {:?} past its share of {MAX_TENANT_BYTES} bytes ({tenant_committed} held \
                     or being computed by its other instances; a quarter of the server's \
                     {MAX_TOTAL_BYTES} is kept for other tenants); unregister instances it no \
                     longer uses, or lower max_positions",
                    tenant.name,
                ),
            ));
        }
        Ok(())
    }

    /// Whether `instance` already holds tables computed from `spec` (a recovery that
    /// re-sends the same parameters computes nothing).
    pub fn holds(&self, instance: InstanceId, spec: &RopeSpec) -> bool {
        self.held
            .get(&instance)
            .is_some_and(|(held, _)| held == spec)
            && !self.pending.contains_key(&instance)
    }

    /// Bytes held and being computed, for the server-wide limit.
    pub fn committed_bytes(&self) -> u64 {
        self.held_bytes
            + self
                .pending
                .values()
                .map(|&(_, _, bytes)| bytes)
                .sum::<u64>()
    }

    /// Bytes held and being computed by the instances `belongs` picks (a tenant's).
    pub fn committed_bytes_of(&self, mut belongs: impl FnMut(InstanceId) -> bool) -> u64 {
        let held: u64 = self
            .held
            .iter()
            .filter(|(instance, _)| belongs(**instance))
            .map(|(_, &(_, bytes))| bytes)
            .sum();
        let pending: u64 = self
            .pending
            .iter()
            .filter(|(instance, _)| belongs(**instance))
            .map(|(_, &(_, _, bytes))| bytes)
            .sum();
        held + pending
    }

    /// Computation `id` of `bytes` for `instance` starts, answering `to` when it ends;
    /// it replaces any still running.
    pub(super) fn begin(
        &mut self,
        id: BlendId,
        to: ReplyTo,
        instance: InstanceId,
        spec: RopeSpec,
        bytes: u64,
    ) {
        self.pending.insert(instance, (id, spec, bytes));
        self.waiting.insert(id, (to, instance));
    }

    /// Computation `id` reported back: the request it answers, and whose (None: not
    /// one this book began, or reported already).
    pub(super) fn reported(&mut self, id: BlendId) -> Option<(ReplyTo, InstanceId)> {
        self.waiting.remove(&id)
    }

    /// Computation `id` failed: it is no longer pending.
    pub fn abandon(&mut self, id: BlendId, instance: InstanceId) {
        if self.pending.get(&instance).map(|&(pending, ..)| pending) == Some(id) {
            self.pending.remove(&instance);
        }
    }

    /// Computation `id` for `instance` finished.
    pub fn finish(&mut self, id: BlendId, instance: InstanceId) -> Finished {
        match self.pending.get(&instance) {
            None => Finished::Freed,
            Some(&(pending, ..)) if pending != id => Finished::Superseded,
            Some(_) => {
                let Some((_, spec, bytes)) = self.pending.remove(&instance) else {
                    return Finished::Freed;
                };
                self.held_bytes += bytes;
                if let Some((_, old)) = self.held.insert(instance, (spec, bytes)) {
                    self.held_bytes -= old;
                }
                Finished::Installed
            }
        }
    }

    /// The instance's last entry went: its tables and any computation still running are
    /// forgotten. Returns the bytes it held (None when it held none).
    pub fn drop_instance(&mut self, instance: InstanceId) -> Option<u64> {
        self.pending.remove(&instance);
        let (_, bytes) = self.held.remove(&instance)?;
        self.held_bytes -= bytes;
        Some(bytes)
    }

    /// Bytes held for `instance` (0 when none).
    pub fn bytes_of(&self, instance: InstanceId) -> u64 {
        self.held.get(&instance).map_or(0, |&(_, bytes)| bytes)
    }

    /// Bytes held by every instance.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// Instances holding tables.
    pub fn instances(&self) -> usize {
        self.held.len()
    }

    /// Computations running.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(rotary_dim: u64, max_positions: u64, base: f64) -> RopeSpec {
        RopeSpec {
            rotary_dim,
            max_positions,
            base,
        }
    }

    fn to() -> ReplyTo {
        ReplyTo {
            conn: crate::node::ConnId(1),
            request_id: 1,
            op: crate::protocol::OpKind::RegisterBlend,
            deadline: None,
        }
    }

    fn id(raw: u64) -> InstanceId {
        InstanceId::new(raw).unwrap()
    }

    #[test]
    fn bad_parameters_name_the_value_and_the_fix() {
        for (bad, words) in [
            (spec(0, 8, 10.0), "rotary_dim 0"),
            (spec(7, 8, 10.0), "rotary_dim 7"),
            (spec(4, 0, 10.0), "max_positions 0"),
            (spec(4, 8, 1.0), "base 1"),
            (spec(4, 8, f64::NAN), "base NaN"),
            (spec(4, 8, f64::INFINITY), "base inf"),
            (spec(128, 1 << 20, 10.0), "268435456 bytes"),
            (spec(u64::MAX - 1, u64::MAX, 10.0), "256 MiB"),
        ] {
            let message = table_bytes(&bad).unwrap_err();
            assert!(message.contains(words), "{words}: {message}");
        }
        assert_eq!(table_bytes(&spec(128, 4096, 10_000.0)), Ok(2 << 20));
        assert_eq!(table_bytes(&spec(128, 1 << 19, 10.0)), Ok(MAX_TABLE_BYTES));
    }

    #[test]
    fn late_results_of_freed_or_superseded_requests_are_never_held() {
        let mut book = BlendBook::default();
        let small = spec(4, 8, 10.0);
        book.begin(BlendId(1), to(), id(1), small.clone(), 128);
        assert_eq!(book.committed_bytes(), 128);
        book.begin(BlendId(2), to(), id(1), small.clone(), 128);
        assert_eq!(book.reported(BlendId(1)), Some((to(), id(1))));
        assert_eq!(book.reported(BlendId(1)), None, "reported once");
        assert_eq!(book.finish(BlendId(1), id(1)), Finished::Superseded);
        assert_eq!(book.finish(BlendId(2), id(1)), Finished::Installed);
        assert_eq!((book.held_bytes(), book.bytes_of(id(1))), (128, 128));
        assert!(book.holds(id(1), &small));
        assert!(!book.holds(id(1), &spec(4, 16, 10.0)));

        book.begin(BlendId(3), to(), id(2), small.clone(), 128);
        assert!(book.drop_instance(id(2)).is_none());
        assert_eq!(book.finish(BlendId(3), id(2)), Finished::Freed);
        assert_eq!(book.bytes_of(id(2)), 0);

        assert_eq!(book.drop_instance(id(1)), Some(128));
        assert_eq!((book.held_bytes(), book.instances()), (0, 0));
        assert_eq!(book.committed_bytes(), 0);
    }
}
