//! The benchmark's clients: keys, a worker of a server, a Redis Cluster client, and the
//! cluster it starts.

use crate::raw::{RawConnection, instance_ids, memfd_spec};
use crate::redis_cluster::{self, RedisCluster};
use crate::{BenchError, progress};
use kvwarden_client::memfd::{SharedMapping, create};
use rmpv::Value;
use rustix::fd::{AsFd, OwnedFd};

/// The L1 slot of both servers: the largest chunk.
use super::*;

/// Fresh keys, never used before in this run.
#[derive(Default)]
pub(super) struct Keys(u64);

impl Keys {
    pub(super) fn fresh(&mut self, count: u64) -> Vec<Vec<u8>> {
        let first = self.0;
        self.0 += count;
        (first..first + count)
            .map(|n| format!("chunk-{n}").into_bytes())
            .collect()
    }
}

/// A registered server-driven worker with one buffer: a source chunk, then `targets`
/// target chunks.
pub(super) struct Worker {
    pub(super) connection: std::cell::RefCell<RawConnection>,
    pub(super) instance: u64,
    pub(super) mapping: SharedMapping,
    pub(super) chunk: u64,
    pub(super) _memfd: OwnedFd,
}

impl Worker {
    pub(super) fn new(
        socket: &std::path::Path,
        chunk: u64,
        targets: u64,
    ) -> Result<Worker, BenchError> {
        let bytes = (1 + targets) * chunk;
        let memfd = create("kvwarden-bench-l2", bytes)
            .map_err(BenchError::io("creating a worker's memfd"))?;
        let mapping = SharedMapping::map(&memfd, bytes as usize)
            .map_err(BenchError::io("mapping a worker's memfd"))?;
        let instance = instance_ids(1)[0];
        let mut connection = RawConnection::connect(socket)?;
        connection.register(instance, vec![memfd_spec(0, bytes)], &[memfd.as_fd()])?;
        Ok(Worker {
            connection: std::cell::RefCell::new(connection),
            instance,
            mapping,
            chunk,
            _memfd: memfd,
        })
    }

    /// Stores `nbytes` of `key`'s pattern.
    pub(super) fn store(&self, key: &[u8], nbytes: u64) -> Result<(), BenchError> {
        self.mapping.write(0, &pattern(key, nbytes));
        let stored = self.connection.borrow_mut().call(
            "store",
            vec![
                self.instance.into(),
                Value::Binary(key.to_vec()),
                0u64.into(),
                0u64.into(),
                nbytes.into(),
            ],
        )?;
        if stored != Value::Boolean(true) {
            return Err(BenchError::Failed(format!(
                "storing {} answered {stored}",
                String::from_utf8_lossy(key)
            )));
        }
        Ok(())
    }

    /// Retrieves `key`, a chunk of this worker's size, into the first target: bytes
    /// moved, or None on a miss.
    pub(super) fn retrieve(&self, key: &[u8]) -> Result<Option<u64>, BenchError> {
        let moved = self.connection.borrow_mut().call(
            "retrieve",
            vec![
                self.instance.into(),
                Value::Binary(key.to_vec()),
                0u64.into(),
                self.chunk.into(),
                self.chunk.into(),
            ],
        )?;
        Ok(moved.as_u64())
    }

    /// Retrieves `keys` in one `retrieve_batch`, each into a target of its own: bytes
    /// moved for each, or None on a miss.
    pub(super) fn retrieve_batch(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<u64>>, BenchError> {
        let items = keys
            .iter()
            .enumerate()
            .map(|(i, key)| {
                Value::Array(vec![
                    Value::Binary(key.clone()),
                    0u64.into(),
                    ((1 + i as u64) * self.chunk).into(),
                    self.chunk.into(),
                ])
            })
            .collect();
        let answers = self.connection.borrow_mut().call(
            "retrieve_batch",
            vec![self.instance.into(), Value::Array(items)],
        )?;
        match answers {
            Value::Array(answers) if answers.len() == keys.len() => {
                Ok(answers.iter().map(Value::as_u64).collect())
            }
            other => Err(BenchError::Failed(format!(
                "retrieve_batch of {} keys answered {other}",
                keys.len()
            ))),
        }
    }

    pub(super) fn read_back(&self, nbytes: u64) -> Vec<u8> {
        let mut out = vec![0; nbytes as usize];
        self.mapping.read(self.chunk, &mut out);
        out
    }
}

/// A Redis Cluster client for the baselines.
pub(super) struct Redis(std::cell::RefCell<redis::cluster::ClusterConnection>);

impl Redis {
    pub(super) fn connect(seeds: &[String]) -> Result<Redis, BenchError> {
        let failed = |error: redis::RedisError| {
            BenchError::Failed(format!("connecting to the cluster {seeds:?}: {error}"))
        };
        let connection = redis::cluster::ClusterClient::new(seeds.to_vec())
            .map_err(failed)?
            .get_connection()
            .map_err(failed)?;
        Ok(Redis(std::cell::RefCell::new(connection)))
    }

    pub(super) fn get(&self, name: &[u8]) -> Result<Option<Vec<u8>>, BenchError> {
        redis::cmd("GET")
            .arg(name)
            .query(&mut *self.0.borrow_mut())
            .map_err(|error| BenchError::Failed(format!("GET: {error}")))
    }

    /// GETs of every name in one pipeline (redis-rs splits it by node).
    pub(super) fn get_pipelined(&self, names: &[Vec<u8>]) -> Result<(), BenchError> {
        let mut pipe = redis::cluster::cluster_pipe();
        for name in names {
            pipe.cmd("GET").arg(name);
        }
        let values: Vec<Option<Vec<u8>>> = pipe
            .query(&mut self.0.borrow_mut())
            .map_err(|error| BenchError::Failed(format!("pipelined GET: {error}")))?;
        std::hint::black_box(values);
        Ok(())
    }

    /// Deletes every name.
    pub(super) fn del(&self, names: &[Vec<u8>]) -> Result<(), BenchError> {
        for group in names.chunks(256) {
            let mut pipe = redis::cluster::cluster_pipe();
            for name in group {
                pipe.cmd("DEL").arg(name).ignore();
            }
            pipe.exec(&mut self.0.borrow_mut())
                .map_err(|error| BenchError::Failed(format!("DEL: {error}")))?;
        }
        Ok(())
    }

    pub(super) fn set(&self, name: &[u8], value: &[u8]) -> Result<(), BenchError> {
        redis::cmd("SET")
            .arg(name)
            .arg(value)
            .exec(&mut *self.0.borrow_mut())
            .map_err(|error| BenchError::Failed(format!("SET: {error}")))
    }
}

/// A Redis Cluster on loopback, 3 masters with 1 replica each; every process is
/// SIGKILLed when it drops (and by the kernel should this process die first).
pub(super) fn start_cluster(node_timeout_ms: u64) -> Result<RedisCluster, BenchError> {
    redis_cluster::require(&redis_cluster::REDIS_PROGRAMS).map_err(|error| {
        BenchError::Failed(format!("{error}; or name a running cluster with --l2"))
    })?;
    let cluster = RedisCluster::start_with_node_timeout(3, 1, node_timeout_ms)?;
    progress(&format!(
        "started a Redis Cluster on loopback: 3 masters, 1 replica each, \
         cluster-node-timeout {node_timeout_ms} ms"
    ));
    Ok(cluster)
}

/// The node's key for this process's `key`: its uid's tenant (`uid-<uid>`) first, as
/// the servers it drives store it in L1 and L2.
pub(super) fn own_tenant_key(key: &[u8]) -> Vec<u8> {
    let tenant = format!("uid-{}", rustix::process::getuid().as_raw());
    kvwarden_core::node::trust::scoped_key(&tenant, key)
}
