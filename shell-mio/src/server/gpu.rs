//! The server's GPUs: probed once at start (a primary context's first use costs
//! ~150 ms, which must never land on a worker's REGISTER), the L1 pool page-locked for
//! DMA, and device memory sampled off the event loop for `/status` (a driver call that
//! hangs must never stop the loop that answers pings).

use crate::cuda::{DeviceMemory, Gpu};
use crate::memfd::SharedMapping;
use kvwarden_core::protocol::status::{GpuMemoryStatus, GpuStatus};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often device memory is sampled for status.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// The GPUs this server can use, or why there are none.
#[derive(Debug)]
pub struct GpuState {
    gpu: Result<Arc<Gpu>, String>,
    memory: Arc<Mutex<Vec<DeviceMemory>>>,
}

impl GpuState {
    /// Probes the driver; on success page-locks `l1` and starts the memory sampler.
    pub fn start(l1: &SharedMapping) -> GpuState {
        let memory = Arc::new(Mutex::new(Vec::new()));
        let gpu = match Gpu::probe() {
            Ok(gpu) => Arc::new(gpu),
            Err(error) => {
                tracing::info!(reason = %error, "no GPU: CUDA buffers (cuda_ipc, cuda_vmm) will be answered `unavailable`");
                return GpuState {
                    gpu: Err(error.to_string()),
                    memory,
                };
            }
        };
        tracing::info!(devices = gpu.device_count(), "CUDA devices ready");
        if let Some(ptr) = l1.range_ptr(0, l1.len() as u64) {
            // SAFETY: the L1 pool is mapped for the server's whole life (it is never
            // unmapped before exit), which is what page-locking requires.
            match unsafe { gpu.pin_host(ptr, l1.len()) } {
                Ok(()) => tracing::info!(bytes = l1.len(), "L1 pool page-locked for DMA"),
                Err(error) => {
                    tracing::warn!(%error, "page-locking the L1 pool failed; device copies go through staging (slower)")
                }
            }
        }
        let sampler_gpu = Arc::clone(&gpu);
        let sampled = Arc::clone(&memory);
        let spawned = std::thread::Builder::new()
            .name("kvwarden-gpu-memory".into())
            .spawn(move || {
                loop {
                    match sampler_gpu.memory() {
                        Ok(now) => *sampled.lock().unwrap_or_else(|e| e.into_inner()) = now,
                        Err(error) => tracing::warn!(%error, "sampling device memory failed"),
                    }
                    std::thread::sleep(SAMPLE_EVERY);
                }
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "no device-memory sampler: /status shows no GPU memory");
        }
        GpuState {
            gpu: Ok(gpu),
            memory,
        }
    }

    /// The GPUs, or why this server has none (the reason an `unavailable` reply gives).
    pub fn gpu(&self) -> Result<&Arc<Gpu>, &str> {
        self.gpu.as_ref().map_err(String::as_str)
    }

    /// The last device-memory sample (empty without a GPU).
    pub fn memory_samples(&self) -> Vec<DeviceMemory> {
        self.memory
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The `gpu` section of the status map.
    pub fn status(&self) -> GpuStatus {
        match &self.gpu {
            Ok(gpu) => GpuStatus::Available {
                available: true,
                devices: gpu.device_count(),
                memory: self
                    .memory
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .map(|m| GpuMemoryStatus {
                        device: m.device,
                        free_bytes: m.free_bytes,
                        total_bytes: m.total_bytes,
                    })
                    .collect(),
            },
            Err(reason) => GpuStatus::Unavailable {
                available: false,
                reason: reason.clone(),
            },
        }
    }
}
