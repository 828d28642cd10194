//! A real Redis Cluster (or one plain Redis) on loopback ports, for the L2 tests: the
//! bench crate's [`kvwarden_bench::redis_cluster::RedisCluster`] (started in a
//! temporary directory, created with `redis-cli --cluster create`, and always torn
//! down: dropping it SIGKILLs every Redis process it started, stopped ones included,
//! and removes the directory), with constructors that panic instead of returning an
//! error, as a test does.

use kvwarden_bench::redis_cluster as shared;
pub use kvwarden_bench::redis_cluster::{CLUSTER_NODE_TIMEOUT_MS, RedisNode};
use std::ops::Deref;

/// A Redis Cluster, or one plain Redis, owned by a test. Its queries and signals
/// (`seeds`, `live_ports`, `masters`, `stop_all`, `cont_all`, `dir`) are those of
/// [`shared::RedisCluster`], through `Deref`.
pub struct RedisCluster(shared::RedisCluster);

/// Panics, saying how to install Redis, unless `redis-server` and `redis-cli` are on
/// PATH.
fn require_redis() {
    if let Err(error) = shared::require(&shared::REDIS_PROGRAMS) {
        panic!("{error}. The L2 tests need a real Redis; `.ci/run` installs it by itself");
    }
}

impl RedisCluster {
    /// Starts `masters` masters with `replicas` replicas each (`cluster-node-timeout`
    /// [`CLUSTER_NODE_TIMEOUT_MS`]), creates the cluster and waits until every node says
    /// `cluster_state:ok` and every replica is in sync with its master.
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        require_redis();
        RedisCluster(
            shared::RedisCluster::start(masters, replicas).unwrap_or_else(|error| {
                panic!("starting a Redis Cluster of {masters} masters x {replicas}: {error}")
            }),
        )
    }

    /// Starts one plain Redis (cluster support off).
    pub fn single() -> RedisCluster {
        require_redis();
        RedisCluster(
            shared::RedisCluster::single()
                .unwrap_or_else(|error| panic!("starting a plain Redis: {error}")),
        )
    }

    /// Waits until every live node says `cluster_state:ok` and every live replica's link
    /// to its master is up.
    pub fn wait_ok(&self) {
        self.0.wait_ok().unwrap_or_else(|error| panic!("{error}"));
    }

    /// SIGKILLs the node on `port` and reaps it.
    pub fn kill(&mut self, port: u16) {
        assert!(self.0.kill(port), "no Redis node on port {port}");
    }
}

impl Deref for RedisCluster {
    type Target = shared::RedisCluster;

    fn deref(&self) -> &shared::RedisCluster {
        &self.0
    }
}
