//! CacheBlend rope state: each instance's RoPE cos/sin tables, computed on the server
//! from `register_blend` and kept until the instance's last entry goes (the core's
//! `Effect::DropBlendState`: unregister, reap, process exit).
//!
//! A table pair is `max_positions × rotary_dim / 2` f32 values each; big ones take
//! far longer than a loop turn to compute or to free, so both happen on the context
//! pool. The bookkeeping (which instance holds what, which computation is still wanted,
//! the limits) lives in the node ([`kvwarden_core::node::blend`]); the shell holds the
//! tables themselves.

use crate::protocol::RopeSpec;
pub use kvwarden_core::node::blend::{MAX_TABLE_BYTES, MAX_TOTAL_BYTES, table_bytes};

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

    /// The parameters' checks are the node's (`kvwarden_core::node::blend`, tested
    /// there); computing refuses what they refuse, with their message.
    #[test]
    fn computing_refuses_what_the_checks_refuse() {
        for bad in [spec(0, 8, 10.0), spec(4, 0, 10.0), spec(4, 8, f64::NAN)] {
            let refused = RopeTables::compute(&bad).unwrap_err();
            assert_eq!(Err(refused), table_bytes(&bad));
        }
        assert!(RopeTables::compute(&spec(4, 8, 10.0)).is_ok());
    }
}
