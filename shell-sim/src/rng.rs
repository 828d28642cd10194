//! The one seeded generator every random choice of a run comes from.
//!
//! xoshiro256** seeded through SplitMix64: small, fast, and the same bits on every
//! platform, so a seed replays bit for bit. Nothing else in the simulator may draw
//! randomness (no OS entropy, no hash-map iteration order reaching the trace).

/// xoshiro256** (Blackman and Vigna), seeded with SplitMix64.
#[derive(Clone, Debug)]
pub struct Rng {
    state: [u64; 4],
}

impl Rng {
    /// The generator for `seed`; every seed (zero included) gives a usable state.
    pub fn new(seed: u64) -> Rng {
        let mut mix = seed;
        let mut state = [0u64; 4];
        for word in &mut state {
            *word = splitmix64(&mut mix);
        }
        Rng { state }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let [s0, s1, s2, s3] = self.state;
        let result = s1.wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s1 << 17;
        let mut s = [s0, s1, s2 ^ s0, s3 ^ s1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        self.state = s;
        result
    }

    /// A float uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// True with probability `p`; draws nothing when `p` is 0 or 1, so a fault turned
    /// off does not shift the rest of the run's random stream... within one profile.
    pub fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        if p >= 1.0 {
            return true;
        }
        self.unit() < p
    }

    /// A value uniform in `[low, high]` (inclusive); `low` when the range is empty.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        if high <= low {
            return low;
        }
        let span = high - low + 1;
        low + self.next_u64() % span
    }

    /// One element of `choices`, uniformly.
    pub fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
        choices[self.between(0, choices.len() as u64 - 1) as usize]
    }
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_other_seed_other_stream() {
        let a: Vec<u64> = (0..8)
            .map({
                let mut rng = Rng::new(7);
                move |_| rng.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..8)
            .map({
                let mut rng = Rng::new(7);
                move |_| rng.next_u64()
            })
            .collect();
        let c = Rng::new(8).next_u64();
        assert_eq!(a, b);
        assert_ne!(a[0], c);
    }

    #[test]
    fn between_stays_in_range_and_unit_below_one() {
        let mut rng = Rng::new(1);
        for _ in 0..1000 {
            let v = rng.between(3, 5);
            assert!((3..=5).contains(&v));
            assert!(rng.unit() < 1.0);
        }
        assert_eq!(rng.between(9, 2), 9);
    }
}
