//! Percentiles of recorded samples (nearest rank over the sorted samples: no
//! interpolation, so every figure printed is a value that was actually measured).

use std::time::Duration;

/// Samples in nanoseconds, sorted once.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    sorted_ns: Vec<u64>,
}

impl Samples {
    /// Sorts `samples_ns`.
    pub fn new(mut samples_ns: Vec<u64>) -> Samples {
        samples_ns.sort_unstable();
        Samples {
            sorted_ns: samples_ns,
        }
    }

    /// From durations.
    pub fn from_durations(samples: &[Duration]) -> Samples {
        Samples::new(
            samples
                .iter()
                .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
                .collect(),
        )
    }

    /// How many samples.
    pub fn len(&self) -> usize {
        self.sorted_ns.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.sorted_ns.is_empty()
    }

    /// The `q` quantile (0..=1) in nanoseconds: the sample at rank ⌈q·n⌉ (nearest
    /// rank); 0 when there are no samples.
    pub fn quantile_ns(&self, q: f64) -> u64 {
        let n = self.sorted_ns.len();
        if n == 0 {
            return 0;
        }
        let rank = (q.clamp(0.0, 1.0) * n as f64).ceil() as usize;
        self.sorted_ns[rank.clamp(1, n) - 1]
    }

    /// The `q` quantile in microseconds.
    pub fn quantile_us(&self, q: f64) -> f64 {
        self.quantile_ns(q) as f64 / 1e3
    }

    /// The `q` quantile in milliseconds.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        self.quantile_ns(q) as f64 / 1e6
    }

    /// The largest sample in milliseconds.
    pub fn max_ms(&self) -> f64 {
        self.sorted_ns.last().copied().unwrap_or(0) as f64 / 1e6
    }
}

#[cfg(test)]
mod tests {
    use super::Samples;

    #[test]
    fn nearest_rank_picks_measured_values() {
        let samples = Samples::new((1..=100).rev().collect());
        assert_eq!(samples.quantile_ns(0.5), 50);
        assert_eq!(samples.quantile_ns(0.99), 99);
        assert_eq!(samples.quantile_ns(0.999), 100);
        assert_eq!(samples.quantile_ns(0.0), 1);
        assert_eq!(Samples::default().quantile_ns(0.5), 0);
    }
}
