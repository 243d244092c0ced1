//! Device selection, what the device can do, candle's global GEMM switches, and memory probes.

use crate::error::SpeedkitError;
use candle_core::Device;
use serde::{Deserialize, Serialize};

/// `--device auto|cpu|cuda[:N]`
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceRequest {
    Auto,
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceRequest {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" | "gpu" => Ok(DeviceRequest::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceRequest::Cuda(n)),
                _ => Err(format!("'{s}' is not a device; use auto, cpu, cuda or cuda:N (N = GPU index)")),
            },
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
}

/// What the stages need to choose a precision, and what the report prints.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub kind: DeviceKind,
    pub ordinal: usize,
    pub name: String,
    /// The CUDA compute capability; `None` on CPU.
    pub sm: Option<(u32, u32)>,
    pub memory_bytes: Option<u64>,
    /// candle's CPU worker threads (1 on CUDA).
    pub threads: usize,
    /// "requested", or what `auto` found.
    pub why: String,
    /// On a CPU, which of `CPU_FLAGS` /proc/cpuinfo reports, for the tables' header.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cpu_flags: Vec<String>,
}

impl DeviceInfo {
    /// For tests and the precision policy's exhaustive table.
    pub fn simulated_cuda(name: &str, sm: (u32, u32)) -> Self {
        Self::cuda(0, name.into(), Some(sm), None, "simulated".into())
    }

    fn cuda(ordinal: usize, name: String, sm: Option<(u32, u32)>, memory_bytes: Option<u64>, why: String) -> Self {
        DeviceInfo { kind: DeviceKind::Cuda, ordinal, name, sm, memory_bytes, threads: 1, why, cpu_flags: Vec::new() }
    }

    pub fn is_cuda(&self) -> bool {
        self.kind == DeviceKind::Cuda
    }

    /// bf16 tensor cores and TF32 arrived together with Ampere (SM 8.0): this answers for both.
    pub fn has_bf16_tensor_cores(&self) -> bool {
        self.sm >= Some((8, 0))
    }
    /// Volta (SM 7.0) onwards.
    pub fn has_f16_tensor_cores(&self) -> bool {
        self.sm >= Some((7, 0))
    }
    /// FP8 (E4M3/E5M2): Ada (SM 8.9) and Hopper (SM 9.0) onwards.
    pub fn has_fp8_tensor_cores(&self) -> bool {
        self.sm >= Some((8, 9))
    }

    pub fn describe(&self) -> String {
        let DeviceInfo { ordinal, name, threads, why, .. } = self;
        let mem = self.memory_bytes.map(|b| format!(", {:.1} GiB", b as f64 / (1u64 << 30) as f64)).unwrap_or_default();
        let yes_no = |b: bool| if b { "yes" } else { "no" };
        let (bf16, fp8) = (yes_no(self.has_bf16_tensor_cores()), yes_no(self.has_fp8_tensor_cores()));
        match self.sm {
            Some((ma, mi)) => {
                format!("cuda:{ordinal} {name} (SM {ma}.{mi}{mem}; bf16 tensor cores: {bf16}, TF32: {bf16}, FP8: {fp8}) [{why}]")
            }
            None => format!("cpu {name} ({threads} threads{mem}; no tensor cores: every precision runs on the SIMD units) [{why}]"),
        }
    }
}

/// `auto` takes GPU 0 when this build has CUDA and a GPU answers, else the CPU, and says why.
pub fn select(req: DeviceRequest) -> Result<(Device, DeviceInfo), SpeedkitError> {
    let why = match req {
        DeviceRequest::Cpu => "requested with --device cpu".into(),
        DeviceRequest::Cuda(n) => return open_cuda(n, format!("requested with --device cuda:{n}")),
        DeviceRequest::Auto if !cfg!(feature = "cuda") => {
            "auto: this build has no CUDA support (build with --features cuda for the GPU)".into()
        }
        DeviceRequest::Auto => match cuda_device_count() {
            Ok(n) if n > 0 => return open_cuda(0, format!("auto: first of {n} CUDA device(s)")),
            Ok(_) => "auto: CUDA build, but the driver reports no GPU".into(),
            Err(e) => format!("auto: CUDA build, but no usable driver/GPU ({e})"),
        },
    };
    Ok((Device::Cpu, cpu_info(why)))
}

/// The SIMD and matrix-unit flags the kernels care about.
const CPU_FLAGS: [&str; 9] = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"];

fn cpu_info(why: String) -> DeviceInfo {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| info.lines().find(|l| l.starts_with(key)).and_then(|l| l.split(':').nth(1)).map(str::trim);
    let name = field("model name").map_or_else(|| std::env::consts::ARCH.to_string(), String::from);
    let have: Vec<&str> = field("flags").unwrap_or_default().split_whitespace().collect();
    let cpu_flags = CPU_FLAGS.iter().filter(|f| have.contains(f)).map(|f| f.to_string()).collect();
    let (memory_bytes, threads, why) = (proc_bytes("/proc/meminfo", "MemTotal:"), candle_core::utils::get_num_threads(), why);
    DeviceInfo { kind: DeviceKind::Cpu, ordinal: 0, name, sm: None, memory_bytes, threads, why, cpu_flags }
}

/// A "Key: N kB" line of a /proc file (meminfo, self/status), in bytes.
fn proc_bytes(file: &str, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(file).ok()?;
    let kib: u64 = s.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// RLIMIT_AS less the address space this process already maps (VmSize), when a limit is set.
fn address_space_left() -> Option<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `lim`, a valid pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(lim.rlim_cur.saturating_sub(proc_bytes("/proc/self/status", "VmSize:")?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device_count() -> Result<usize, String> {
    Ok(0)
}

#[cfg(feature = "cuda")]
fn cuda_device_count() -> Result<usize, String> {
    candle_core::cuda::cudarc::driver::CudaContext::device_count().map(|n| n as usize).map_err(|e| format!("{e:?}"))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(n: usize, _why: String) -> Result<(Device, DeviceInfo), SpeedkitError> {
    Err(SpeedkitError::usage(format!(
        "--device cuda:{n} was requested, but this binary was built without CUDA support. Fix: rebuild with the cuda feature, \
         e.g. `cargo run --release --features cuda -p ladder -- --device cuda` (needs the CUDA toolkit's nvcc at build time \
         and an NVIDIA GPU with its driver at run time), or run on the CPU with --device cpu."
    )))
}

#[cfg(feature = "cuda")]
fn open_cuda(n: usize, why: String) -> Result<(Device, DeviceInfo), SpeedkitError> {
    let count = cuda_device_count().map_err(|e| {
        SpeedkitError::usage(format!(
            "--device cuda:{n} was requested, but the CUDA driver did not answer ({e}). Fix: check that an NVIDIA GPU \
             and its driver (CUDA 13 / driver 580+) are visible (nvidia-smi), or run with --device cpu."
        ))
    })?;
    if n >= count {
        let last = count.saturating_sub(1);
        let why = format!("--device cuda:{n} was requested, but the driver sees {count} GPU(s) (indices 0..{last})");
        return Err(SpeedkitError::usage(format!("{why}. Fix: pick an index below {count}, or --device cpu.")));
    }
    let device = Device::new_cuda(n).map_err(|e| {
        SpeedkitError::usage(format!("could not open cuda:{n} ({e}). Fix: check the GPU with nvidia-smi, or run with --device cpu."))
    })?;
    let cuda = device.as_cuda_device().expect("just created as CUDA");
    // Before any tensor exists: cudarc's per-allocation read/write events order uses across
    // streams. On candle's one stream they guard nothing, inflate the timings of the stages that
    // allocate most (0–2) at small shapes, and a CUDA graph capture would record them.
    // SAFETY: no tensor of this device is used on another stream (cudarc's condition).
    unsafe { cuda.disable_event_tracking() };
    let ctx = cuda.cuda_stream().context().clone();
    let (name, sm) = (ctx.name().unwrap_or_else(|_| "unknown NVIDIA GPU".into()), ctx.compute_capability().ok());
    let info = DeviceInfo::cuda(n, name, sm.map(|(a, b)| (a as u32, b as u32)), ctx.total_mem().ok().map(|b| b as u64), why);
    Ok((device, info))
}

/// candle's process-wide GEMM switches (no-ops on CPU): every stage's `build` sets all three, so no
/// stage inherits another's numerics. `tf32`: f32 GEMMs on TF32 tensor cores; `reduced_*`: f16 /
/// bf16 GEMMs may accumulate in reduced precision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GemmSwitches {
    pub tf32: bool,
    pub reduced_f16: bool,
    pub reduced_bf16: bool,
}

static APPLIED: std::sync::Mutex<GemmSwitches> = std::sync::Mutex::new(GemmSwitches::OFF);

impl GemmSwitches {
    /// Exact fp32 everywhere: what the reference and stage 0 run with.
    pub const OFF: GemmSwitches = GemmSwitches { tf32: false, reduced_f16: false, reduced_bf16: false };

    pub fn apply(self) {
        candle_core::cuda::set_gemm_reduced_precision_f32(self.tf32);
        candle_core::cuda::set_gemm_reduced_precision_f16(self.reduced_f16);
        candle_core::cuda::set_gemm_reduced_precision_bf16(self.reduced_bf16);
        *APPLIED.lock().unwrap_or_else(|e| e.into_inner()) = self;
    }

    pub fn describe(self) -> String {
        let on = |b: bool| if b { "on" } else { "off" };
        format!("TF32 {} · reduced-precision f16 {} · bf16 {}", on(self.tf32), on(self.reduced_f16), on(self.reduced_bf16))
    }

    /// The switches in force. Without CUDA candle's stand-in getters always answer `true`, so
    /// this is what was last applied.
    pub fn current() -> GemmSwitches {
        if !cfg!(feature = "cuda") {
            return *APPLIED.lock().unwrap_or_else(|e| e.into_inner());
        }
        GemmSwitches {
            tf32: candle_core::cuda::gemm_reduced_precision_f32(),
            reduced_f16: candle_core::cuda::gemm_reduced_precision_f16(),
            reduced_bf16: candle_core::cuda::gemm_reduced_precision_bf16(),
        }
    }
}

/// Bytes available for a new allocation: MemAvailable on CPU (Linux), free memory on CUDA.
pub fn available_bytes(device: &Device) -> Option<u64> {
    match device {
        // An address-space limit (`ulimit -v`) caps what this process can allocate whatever
        // the machine has free; past it an allocation fails and Rust aborts.
        Device::Cpu => [proc_bytes("/proc/meminfo", "MemAvailable:"), address_space_left()].into_iter().flatten().min(),
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            // What earlier work freed stays reserved in the default pool (cuMemFreeAsync keeps it
            // for reuse) and does not show as free: after a te training step of stage 0 the
            // device reported 0.25 GiB free with ~68 GiB idle in the pool, and the next stage ran
            // out of memory. Hand the idle part back first, so "free" is what a stage can have.
            cuda_pool::trim(d);
            d.cuda_stream().context().mem_get_info().ok().map(|(free, _)| free as u64)
        }
        _ => None,
    }
}

/// The peak memory a stretch of work needs, from a high-water mark reset at the start, so a
/// transient freed before the end (stage 0's T×T scores) still counts. CPU (Linux): VmHWM, reset
/// through /proc/self/clear_refs. CUDA: `USED_MEM_HIGH` of the default pool plus the graph pool's.
pub struct MemProbe {
    start: Option<u64>,
    peak: u64,
    method: &'static str,
    counters: Box<dyn MemCounters>,
}

/// A device's memory counters (the defaults: none). `synchronize` lets queued frees land (the GPU's
/// queue; glibc's free lists), `used` is bytes in use now, `high` the most since `reset_high`.
trait MemCounters {
    fn synchronize(&mut self) {}
    fn used(&mut self) -> Option<u64> {
        None
    }
    fn reset_high(&mut self) {}
    fn high(&mut self) -> Option<u64> {
        None
    }
}

impl MemCounters for () {}

impl MemProbe {
    pub fn start(device: &Device) -> MemProbe {
        let none = "cuda: no memory pool counters";
        let (counters, method): (Box<dyn MemCounters>, _) = match device {
            Device::Cpu if std::fs::write("/proc/self/clear_refs", "5").is_ok() => {
                (Box::new(CpuCounters), "cpu: peak RSS growth (VmHWM reset)")
            }
            Device::Cpu => (Box::new(CpuCounters), "cpu: peak RSS growth (VmHWM not resettable: upper bound)"),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => match cuda_pool::PoolCounters::new(d) {
                Ok(c) => (Box::new(c), "cuda: high-water mark of the default memory pool (+ graph pool)"),
                Err(_) => (Box::new(()), none),
            },
            _ => (Box::new(()), none),
        };
        MemProbe::with_counters(counters, method)
    }

    fn with_counters(mut counters: Box<dyn MemCounters>, method: &'static str) -> MemProbe {
        counters.synchronize(); // frees still queued from earlier work must not count as in use
        let start = counters.used();
        counters.reset_high();
        MemProbe { start, peak: start.unwrap_or(0), method, counters }
    }

    fn fold_high(&mut self) {
        self.counters.synchronize();
        self.peak = self.peak.max(self.counters.high().unwrap_or(0));
    }

    /// Run `f` (a stage's own check) without counting what it allocates.
    pub fn exclude<T>(&mut self, f: impl FnOnce() -> T) -> T {
        self.fold_high();
        let out = f();
        self.counters.synchronize();
        self.counters.reset_high();
        out
    }

    pub fn finish(mut self) -> (Option<u64>, &'static str) {
        self.fold_high();
        (self.start.map(|s| self.peak.saturating_sub(s)), self.method)
    }
}

/// glibc's malloc set to keep freed memory for reuse: every allocation comes from the heap (mmap
/// off; glibc still maps where the heap cannot grow), and freed memory is not handed back until
/// 2 GiB of it sits free. With glibc's defaults each large tensor was a fresh mmap — its pages
/// faulted in on first touch, and on free unmapped with a TLB shootdown to every thread's core —
/// at every op of every iteration: about a quarter of a CPU training step
/// (`results/train-engine/allocator.txt`). Raising the mmap threshold instead (32 MiB at most)
/// left the largest tensors mapped: stage 0's (B, n_head, T, T) scores are 48 MiB at `small`.
/// PyTorch's training step, run under the same settings, did not move
/// (`results/cpu-xeon-amx-a7b64cf/README.md`). The memory probe still hands freed memory back
/// before each stage (`malloc_trim`), so a stage's peak is its own. Called first by every
/// binary; elsewhere (another libc) a no-op.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt takes two integers and only changes glibc's thresholds.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

struct CpuCounters;

impl MemCounters for CpuCounters {
    /// Free heap back to the OS, or a stage reusing an earlier one's freed buffers would not grow RSS.
    fn synchronize(&mut self) {
        // SAFETY: glibc's malloc_trim takes no pointers and may be called at any time.
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        let _ = unsafe { libc::malloc_trim(0) };
    }
    fn used(&mut self) -> Option<u64> {
        proc_bytes("/proc/self/status", "VmRSS:")
    }
    fn reset_high(&mut self) {
        let _ = std::fs::write("/proc/self/clear_refs", "5");
    }
    fn high(&mut self) -> Option<u64> {
        proc_bytes("/proc/self/status", "VmHWM:")
    }
}

#[cfg(feature = "cuda")]
mod cuda_pool {
    use super::MemCounters;
    use candle_core::cuda::cudarc::driver::{result, sys, CudaStream, DriverError};
    use std::ffi::c_void;
    use std::sync::Arc;
    use sys::{CUgraphMem_attribute as Graph, CUmemPool_attribute as Pool};

    /// The device's default memory pool (cudarc's `cuMemAllocAsync` allocates from it) and the
    /// device's graph memory (what `--cuda-graph`'s instantiated graphs allocate).
    pub struct PoolCounters {
        stream: Arc<CudaStream>,
        pool: sys::CUmemoryPool,
        dev: sys::CUdevice,
    }

    impl PoolCounters {
        pub fn new(d: &candle_core::cuda::CudaDevice) -> Result<Self, DriverError> {
            let stream = d.cuda_stream();
            stream.context().bind_to_thread()?;
            let dev = stream.context().cu_device();
            // SAFETY: `dev` is this context's device.
            let pool = unsafe { result::device::get_default_mem_pool(dev) }?;
            Ok(PoolCounters { stream, pool, dev })
        }

        /// One cuuint64_t memory attribute, through the pointer `call` is given.
        fn attr(&self, call: impl FnOnce(*mut c_void) -> sys::CUresult) -> Option<u64> {
            let _ = self.stream.context().bind_to_thread();
            let mut v: u64 = 0;
            (call(&mut v as *mut u64 as *mut c_void) == sys::CUresult::CUDA_SUCCESS).then_some(v)
        }
    }

    /// Wait for the device's queue, then release the default pool's idle memory to the device
    /// (cuMemPoolTrimTo(pool, 0)): a stage then starts from the device's free memory, not from
    /// an earlier stage's reserved and fragmented blocks. Errors leave the pool as it was.
    pub fn trim(d: &candle_core::cuda::CudaDevice) {
        let stream = d.cuda_stream();
        if stream.context().bind_to_thread().is_err() || stream.synchronize().is_err() {
            return;
        }
        // SAFETY: the pool is this context's device's default pool, and nothing is queued.
        if let Ok(pool) = unsafe { result::device::get_default_mem_pool(stream.context().cu_device()) } {
            let _ = unsafe { result::mem_pool::trim_to(pool, 0) };
        }
    }

    impl MemCounters for PoolCounters {
        fn synchronize(&mut self) {
            let _ = self.stream.synchronize();
            // SAFETY: the default pool of this stream's device; the queue is drained.
            let _ = unsafe { result::mem_pool::trim_to(self.pool, 0) };
        }
        fn used(&mut self) -> Option<u64> {
            // SAFETY (each `attr` call): the pointer is to a live u64, as these attributes need.
            self.attr(|p| unsafe { sys::cuMemPoolGetAttribute(self.pool, Pool::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, p) })
        }
        fn reset_high(&mut self) {
            // 0, the only value these resets accept, means "from now".
            let _ = self.attr(|p| unsafe { sys::cuMemPoolSetAttribute(self.pool, Pool::CU_MEMPOOL_ATTR_USED_MEM_HIGH, p) });
            let _ = self.attr(|p| unsafe { sys::cuDeviceSetGraphMemAttribute(self.dev, Graph::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, p) });
        }
        fn high(&mut self) -> Option<u64> {
            let pool = self.attr(|p| unsafe { sys::cuMemPoolGetAttribute(self.pool, Pool::CU_MEMPOOL_ATTR_USED_MEM_HIGH, p) })?;
            // Graph allocations live outside the default pool; their mark adds (an upper bound
            // if the two peaks did not coincide).
            let graph = self.attr(|p| unsafe { sys::cuDeviceGetGraphMemAttribute(self.dev, Graph::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, p) });
            Some(pool + graph.unwrap_or(0))
        }
    }
}

#[cfg(test)]
#[path = "../tests/unit/device.rs"]
mod tests;
