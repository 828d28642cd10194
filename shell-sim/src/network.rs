//! The simulated network: per worker, one link in each direction, with delay, jitter
//! (which reorders), loss, duplication and partitions.
//!
//! A partitioned direction drops what is sent, like a black hole: nothing sent into a
//! partition arrives after it heals.

use crate::config::{CutDirection, LinkSpec};
use crate::rng::Rng;
use crate::time::Nanos;

/// The two directions of one worker's link.
#[derive(Clone, Debug)]
struct Link {
    to_server: LinkSpec,
    to_worker: LinkSpec,
    cut_to_server: bool,
    cut_to_worker: bool,
}

/// Every worker's link to the server.
#[derive(Clone, Debug)]
pub struct Network {
    links: Vec<Link>,
    /// Messages lost to loss or partitions, for statistics.
    pub dropped_total: u64,
}

/// Which way a message goes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Way {
    /// Worker to server.
    ToServer,
    /// Server to worker.
    ToWorker,
}

impl Network {
    /// One link per worker, each direction with `specs[slot]`.
    pub fn new(specs: impl IntoIterator<Item = LinkSpec>) -> Network {
        let links = specs
            .into_iter()
            .map(|spec| Link {
                to_server: spec.clone(),
                to_worker: spec,
                cut_to_server: false,
                cut_to_worker: false,
            })
            .collect();
        Network {
            links,
            dropped_total: 0,
        }
    }

    /// When the copies of a message sent now arrive: none (lost), one or two
    /// (duplicated). Draws from `rng` only for faults that are switched on.
    pub fn send(&mut self, rng: &mut Rng, now: Nanos, slot: usize, way: Way) -> [Option<Nanos>; 2] {
        let link = &self.links[slot];
        let (spec, cut) = match way {
            Way::ToServer => (&link.to_server, link.cut_to_server),
            Way::ToWorker => (&link.to_worker, link.cut_to_worker),
        };
        if cut || rng.chance(spec.loss) {
            self.dropped_total += 1;
            return [None, None];
        }
        let arrival = |rng: &mut Rng| {
            let jitter = if spec.jitter > 0 {
                rng.between(0, spec.jitter)
            } else {
                0
            };
            now + spec.delay + jitter
        };
        let first = arrival(rng);
        let second = if spec.duplicate > 0.0 && rng.chance(spec.duplicate) {
            Some(arrival(rng))
        } else {
            None
        };
        [Some(first), second]
    }

    /// Cuts `direction` of the slot's link.
    pub fn partition(&mut self, slot: usize, direction: CutDirection) {
        let link = &mut self.links[slot];
        match direction {
            CutDirection::Both => {
                link.cut_to_server = true;
                link.cut_to_worker = true;
            }
            CutDirection::ToServer => link.cut_to_server = true,
            CutDirection::ToWorker => link.cut_to_worker = true,
        }
    }

    /// Restores both directions of the slot's link and clears its faults.
    pub fn heal(&mut self, slot: usize) {
        let link = &mut self.links[slot];
        link.cut_to_server = false;
        link.cut_to_worker = false;
        for spec in [&mut link.to_server, &mut link.to_worker] {
            spec.loss = 0.0;
            spec.duplicate = 0.0;
        }
    }

    /// Replaces the faults of both directions of the slot's link.
    pub fn set(&mut self, slot: usize, spec: &LinkSpec) {
        let link = &mut self.links[slot];
        link.to_server = spec.clone();
        link.to_worker = spec.clone();
    }

    /// The longest a message on this slot's link can take right now.
    pub fn max_delay(&self, slot: usize) -> Nanos {
        let link = &self.links[slot];
        (link.to_server.delay + link.to_server.jitter)
            .max(link.to_worker.delay + link.to_worker.jitter)
    }
}
