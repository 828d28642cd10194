//! The requests a worker builds: its REGISTER of each module, and its transfers.

use super::{BUFFER_BYTES, STORE_BYTES, Worker, chunk_key};
use kvwarden_core::Module;
use kvwarden_core::protocol::{BufferSpec, Op, RetrieveItem, StoreItem};

impl Worker {
    /// The REGISTER of `module`: one memfd buffer (its fd travels with the frame), or
    /// the engine-driven registration.
    pub(super) fn register_op(&self, module: Module) -> Op {
        match module {
            Module::ServerDriven => Op::RegisterKvCache {
                instance: self.instance,
                buffers: vec![BufferSpec::Memfd {
                    fd_index: 0,
                    nbytes: BUFFER_BYTES,
                }],
                model_name: "sim".to_string(),
                world_size: 1,
            },
            Module::EngineDriven => Op::RegisterEngineDriven {
                instance: self.instance,
                model_name: "sim".to_string(),
                world_size: 1,
            },
        }
    }

    /// A transfer: server-driven cycles through `store` of a fresh key, `retrieve` of
    /// it, `store_batch` of two fresh keys and `retrieve_batch` of them; engine-driven
    /// prepares a store (committed `commit_after` later).
    pub(super) fn transfer_op(&mut self, module: Module) -> Op {
        let instance = self.instance;
        let key = |serial: u64| chunk_key(instance, serial);
        let fresh = key(self.op_serial);
        match module {
            Module::ServerDriven => {
                let previous = self.last_stored.take().unwrap_or_else(|| fresh.clone());
                match self.op_serial % 4 {
                    1 => {
                        self.last_stored = Some(fresh.clone());
                        Op::Store {
                            instance,
                            key: fresh,
                            buffer: 0,
                            offset: 0,
                            nbytes: STORE_BYTES,
                        }
                    }
                    2 => Op::Retrieve {
                        instance,
                        key: previous,
                        buffer: 0,
                        offset: 0,
                        nbytes: STORE_BYTES,
                    },
                    3 => {
                        self.last_stored = Some(fresh.clone());
                        let items = [fresh, key(self.op_serial | 1 << 63)]
                            .into_iter()
                            .enumerate()
                            .map(|(index, key)| StoreItem {
                                key,
                                buffer: 0,
                                offset: index as u64 * STORE_BYTES,
                                nbytes: STORE_BYTES,
                            })
                            .collect();
                        Op::StoreBatch { instance, items }
                    }
                    _ => {
                        let items = [previous, fresh]
                            .into_iter()
                            .enumerate()
                            .map(|(index, key)| RetrieveItem {
                                key,
                                buffer: 0,
                                offset: index as u64 * STORE_BYTES,
                                nbytes: STORE_BYTES,
                            })
                            .collect();
                        Op::RetrieveBatch { instance, items }
                    }
                }
            }
            Module::EngineDriven => Op::PrepareStore {
                instance,
                key: fresh,
            },
        }
    }
}
