//! CacheBlend rope state: each instance's RoPE cos/sin tables, computed on the server
//! from `register_blend` and kept until the instance's last entry goes (the core's
//! `Effect::DropBlendState`: unregister, reap, process exit).
//!
//! A table pair is `max_positions × rotary_dim / 2` f32 values each; big ones take
//! far longer than a loop turn to compute or to free, so both happen on the context
//! pool. The bookkeeping here (which instance holds what, which computation is still
//! wanted) lives on the event loop.

use crate::protocol::RopeSpec;
use kvwarden_core::InstanceId;
use std::collections::HashMap;

/// The most bytes one instance's tables (cos and sin together) may take: 256 MiB
/// holds, for example, rotary_dim 128 at 262,144 positions.
pub const MAX_TABLE_BYTES: u64 = 256 << 20;

/// The most bytes every instance's tables (and those being computed) may take
/// together; beyond it `register_blend` is answered `overloaded`.
pub const MAX_TOTAL_BYTES: u64 = 4 << 30;

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

/// One instance's RoPE tables, row-major `[position][rotary_dim / 2]`.
#[derive(Debug)]
pub struct RopeTables {
    spec: RopeSpec,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTables {
    /// Computes the tables (f64 arithmetic, stored as f32), as inference engines do:
    /// `angle = position × base^(−2i / rotary_dim)`. Checks the parameters first; an
    /// allocation the machine cannot give is an error, never an abort.
    pub fn compute(spec: &RopeSpec) -> Result<RopeTables, String> {
        table_bytes(spec)?;
        let half = usize::try_from(spec.rotary_dim / 2).map_err(|e| e.to_string())?;
        let positions = usize::try_from(spec.max_positions).map_err(|e| e.to_string())?;
        let len = half.saturating_mul(positions);
        let allocate = || {
            let mut table: Vec<f32> = Vec::new();
            table.try_reserve_exact(len).map(|()| table).map_err(|e| {
                format!("allocating rope tables of {len} values failed: {e}; retry later")
            })
        };
        let (mut cos, mut sin) = (allocate()?, allocate()?);
        let inverse_frequencies: Vec<f64> = (0..half)
            .map(|i| spec.base.powf(-2.0 * i as f64 / spec.rotary_dim as f64))
            .collect();
        for position in 0..positions {
            for frequency in &inverse_frequencies {
                let (s, c) = (position as f64 * frequency).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        Ok(RopeTables {
            spec: spec.clone(),
            cos,
            sin,
        })
    }

    /// The parameters the tables were computed from.
    pub fn spec(&self) -> &RopeSpec {
        &self.spec
    }

    /// Bytes held by both tables.
    pub fn bytes(&self) -> u64 {
        ((self.cos.len() + self.sin.len()) * std::mem::size_of::<f32>()) as u64
    }

    /// `(cos, sin)` of `position` for rotary pair `pair`, if inside the tables.
    pub fn at(&self, position: u64, pair: u64) -> Option<(f32, f32)> {
        let half = self.spec.rotary_dim / 2;
        if pair >= half || position >= self.spec.max_positions {
            return None;
        }
        let index = usize::try_from(position * half + pair).ok()?;
        Some((*self.cos.get(index)?, *self.sin.get(index)?))
    }
}

/// A computation asked for by `register_blend`, identified so that a late result for
/// an instance that was freed (or asked again) meanwhile is recognised.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlendTicket {
    instance: InstanceId,
    serial: u64,
}

impl BlendTicket {
    /// The instance the tables are for.
    pub fn instance(self) -> InstanceId {
        self.instance
    }
}

/// What became of a finished computation.
#[derive(Debug)]
pub enum Finished {
    /// The tables are held now; `replaced` (an earlier pair) is to be dropped.
    Installed {
        /// The tables the instance held before, if any.
        replaced: Option<RopeTables>,
    },
    /// A newer `register_blend` of the instance is computing: these are dropped.
    Superseded(RopeTables),
    /// The instance was freed meanwhile: these are dropped, never held.
    Freed(RopeTables),
}

/// Every instance's rope state, and the computations still wanted.
#[derive(Debug, Default)]
pub struct BlendStates {
    held: HashMap<InstanceId, RopeTables>,
    /// instance → (serial, bytes) of the computation whose result is wanted.
    pending: HashMap<InstanceId, (u64, u64)>,
    held_bytes: u64,
    serials: u64,
}

impl BlendStates {
    /// Whether `instance` already holds tables computed from `spec` (a recovery that
    /// re-sends the same parameters computes nothing).
    pub fn holds(&self, instance: InstanceId, spec: &RopeSpec) -> bool {
        self.held
            .get(&instance)
            .is_some_and(|tables| tables.spec() == spec)
            && !self.pending.contains_key(&instance)
    }

    /// Bytes held and being computed, for the server-wide limit.
    pub fn committed_bytes(&self) -> u64 {
        self.held_bytes + self.pending.values().map(|&(_, bytes)| bytes).sum::<u64>()
    }

    /// A computation of `bytes` for `instance` starts; it replaces any still running.
    pub fn begin(&mut self, instance: InstanceId, bytes: u64) -> BlendTicket {
        self.serials += 1;
        self.pending.insert(instance, (self.serials, bytes));
        BlendTicket {
            instance,
            serial: self.serials,
        }
    }

    /// The computation of `ticket` failed: it is no longer pending.
    pub fn abandon(&mut self, ticket: BlendTicket) {
        if self
            .pending
            .get(&ticket.instance)
            .map(|&(serial, _)| serial)
            == Some(ticket.serial)
        {
            self.pending.remove(&ticket.instance);
        }
    }

    /// The computation of `ticket` finished with `tables`.
    pub fn finish(&mut self, ticket: BlendTicket, tables: RopeTables) -> Finished {
        match self.pending.get(&ticket.instance) {
            None => Finished::Freed(tables),
            Some(&(serial, _)) if serial != ticket.serial => Finished::Superseded(tables),
            Some(_) => {
                self.pending.remove(&ticket.instance);
                self.held_bytes += tables.bytes();
                let replaced = self.held.insert(ticket.instance, tables);
                if let Some(old) = &replaced {
                    self.held_bytes -= old.bytes();
                }
                Finished::Installed { replaced }
            }
        }
    }

    /// The instance's last entry went: its tables (to be dropped off the loop) and any
    /// computation still running are forgotten.
    pub fn drop_instance(&mut self, instance: InstanceId) -> Option<RopeTables> {
        self.pending.remove(&instance);
        let tables = self.held.remove(&instance)?;
        self.held_bytes -= tables.bytes();
        Some(tables)
    }

    /// Bytes held for `instance` (0 when none).
    pub fn bytes_of(&self, instance: InstanceId) -> u64 {
        self.held.get(&instance).map_or(0, RopeTables::bytes)
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

    fn id(raw: u64) -> InstanceId {
        InstanceId::new(raw).unwrap()
    }

    #[test]
    fn tables_hold_the_rope_angles() {
        let tables = RopeTables::compute(&spec(4, 8, 10_000.0)).unwrap();
        assert_eq!(tables.bytes(), 8 * 4 * 4);
        assert_eq!(tables.at(0, 0), Some((1.0, 0.0)));
        let (cos, sin) = tables.at(3, 0).unwrap();
        assert!((cos - 3f64.cos() as f32).abs() < 1e-6 && (sin - 3f64.sin() as f32).abs() < 1e-6);
        let (cos, _) = tables.at(5, 1).unwrap();
        assert!(
            (cos - (5.0 / 100.0f64).cos() as f32).abs() < 1e-6,
            "base^(-2/4) = 1/100"
        );
        assert_eq!(tables.at(8, 0), None);
        assert_eq!(tables.at(0, 2), None);
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
            assert!(RopeTables::compute(&bad).is_err());
        }
        assert_eq!(table_bytes(&spec(128, 4096, 10_000.0)), Ok(2 << 20));
        assert_eq!(table_bytes(&spec(128, 1 << 19, 10.0)), Ok(MAX_TABLE_BYTES));
    }

    #[test]
    fn late_results_of_freed_or_superseded_requests_are_never_held() {
        let mut states = BlendStates::default();
        let small = spec(4, 8, 10.0);
        let table = || RopeTables::compute(&small).unwrap();
        let first = states.begin(id(1), 128);
        assert_eq!(states.committed_bytes(), 128);
        let second = states.begin(id(1), 128);
        assert!(matches!(
            states.finish(first, table()),
            Finished::Superseded(_)
        ));
        assert!(matches!(
            states.finish(second, table()),
            Finished::Installed { replaced: None }
        ));
        assert_eq!((states.held_bytes(), states.bytes_of(id(1))), (128, 128));
        assert!(states.holds(id(1), &small));
        assert!(!states.holds(id(1), &spec(4, 16, 10.0)));

        let freed_meanwhile = states.begin(id(2), 128);
        assert!(states.drop_instance(id(2)).is_none());
        assert!(matches!(
            states.finish(freed_meanwhile, table()),
            Finished::Freed(_)
        ));
        assert_eq!(states.bytes_of(id(2)), 0);

        assert!(states.drop_instance(id(1)).is_some());
        assert_eq!((states.held_bytes(), states.instances()), (0, 0));
        assert_eq!(states.committed_bytes(), 0);
    }
}
