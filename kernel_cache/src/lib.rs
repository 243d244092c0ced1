//! Loading the kernels `build.rs` compiled (`kernel_build`): each kernel file comes as one
//! cubin (machine code) per architecture in CUDA_COMPUTE_CAP at build time. At run time the op
//! picks the cubin for the device's SM, or refuses with the fix when the build has none, and
//! loads it once per device: later launches find the function in a cache and do no module work.
//! Stages 2, 3 and 4 load their kernels through this module.

use std::collections::HashMap;
use std::hash::Hash;

/// One kernel file as built: its name (for messages) and a cubin per architecture, given as
/// 10·major + minor (`$OUT_DIR/cubins.rs`, written by build.rs).
#[derive(Clone, Copy, Debug)]
pub struct Cubins {
    pub file: &'static str,
    pub archs: &'static [(u32, &'static [u8])],
}

/// The built architecture whose cubin runs on a device of compute capability `sm` (10·major +
/// minor): a cubin runs on its own major version at the same or a later minor (sm_80 on SM 8.0,
/// 8.6 and 8.9, not on 9.0), and the newest such is picked. Otherwise the refusal: what was
/// built, what the device is, and the fix.
pub fn pick_arch(file: &str, built: &[u32], sm: u32) -> Result<u32, String> {
    let runs = built.iter().copied().filter(|&a| a / 10 == sm / 10 && a % 10 <= sm % 10).max();
    runs.ok_or_else(|| {
        let list: Vec<String> = built.iter().map(|a| format!("sm_{a}")).collect();
        format!(
            "{file} was compiled for {} (CUDA_COMPUTE_CAP at build time), and none of those runs on this GPU, \
             SM {}.{}: machine code runs only on its own major architecture, at the same or a later minor version. \
             Fix: rebuild with CUDA_COMPUTE_CAP={sm} (or a list such as CUDA_COMPUTE_CAP={}, one entry per GPU \
             generation the binary should run on).",
            list.join(", "),
            sm / 10,
            sm % 10,
            built.iter().chain([&sm]).map(u32::to_string).collect::<Vec<_>>().join(","),
        )
    })
}

#[cfg(feature = "cuda")]
pub use load::{check, function, module_loads};

/// Loaded modules per (device, kernel file) and functions per (device, file, function name),
/// with a count of the loads it did: a module is loaded once per device and file, a function
/// looked up once per device, file and name, and every later call is a map lookup. `Dev`
/// identifies a device (candle's `DeviceId` on CUDA), `M` and `F` are what the loader returns
/// (cudarc's module and function; anything in a test).
pub struct KernelCache<Dev, M, F> {
    modules: HashMap<(Dev, &'static str), M>,
    functions: HashMap<(Dev, &'static str, String), F>,
    /// Modules loaded so far (each one copies a cubin onto the GPU through the driver).
    pub module_loads: usize,
    /// Functions looked up in a loaded module so far.
    pub function_lookups: usize,
}

impl<Dev: Clone + Eq + Hash, M: Clone, F: Clone> KernelCache<Dev, M, F> {
    pub fn new() -> Self {
        KernelCache { modules: HashMap::new(), functions: HashMap::new(), module_loads: 0, function_lookups: 0 }
    }

    /// The function `name` of kernel file `file` on `dev`: from the cache, or loaded with
    /// `load_module` (only when this device has not loaded the file yet) and `load_function`.
    /// A failed load is not cached.
    pub fn function<E>(
        &mut self,
        dev: Dev,
        file: &'static str,
        name: &str,
        load_module: impl FnOnce() -> Result<M, E>,
        load_function: impl FnOnce(&M, &str) -> Result<F, E>,
    ) -> Result<F, E> {
        let key = (dev.clone(), file, name.to_string());
        if let Some(f) = self.functions.get(&key) {
            return Ok(f.clone());
        }
        let module = match self.modules.get(&(dev.clone(), file)) {
            Some(m) => m.clone(),
            None => {
                let m = load_module()?;
                self.module_loads += 1;
                self.modules.insert((dev, file), m.clone());
                m
            }
        };
        let f = load_function(&module, name)?;
        self.function_lookups += 1;
        self.functions.insert(key, f.clone());
        Ok(f)
    }
}

impl<Dev: Clone + Eq + Hash, M: Clone, F: Clone> Default for KernelCache<Dev, M, F> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(feature = "cuda")]
mod load {
    use super::{pick_arch, Cubins, KernelCache};
    use candle_core::cuda::cudarc::driver::{CudaFunction, CudaModule};
    use candle_core::cuda::cudarc::nvrtc::Ptx;
    use candle_core::cuda::{CudaDevice, DeviceId};
    use std::sync::{Arc, Mutex, OnceLock};

    fn err(what: String) -> candle_core::Error {
        candle_core::Error::Msg(what)
    }

    /// The device's compute capability as 10·major + minor.
    fn sm_of(dev: &CudaDevice) -> candle_core::Result<u32> {
        let (major, minor) = dev.cuda_stream().context().compute_capability().map_err(|e| err(format!("compute capability: {e:?}")))?;
        Ok(10 * major as u32 + minor as u32)
    }

    /// Refuses up front, with the paragraph of `pick_arch`, when `cubins` has no machine code
    /// for `dev`.
    pub fn check(dev: &CudaDevice, cubins: &Cubins) -> candle_core::Result<()> {
        let built: Vec<u32> = cubins.archs.iter().map(|(a, _)| *a).collect();
        pick_arch(cubins.file, &built, sm_of(dev)?).map(|_| ()).map_err(err)
    }

    type Kernels = KernelCache<DeviceId, Arc<CudaModule>, CudaFunction>;

    /// Keyed by candle's `DeviceId` (one per `CudaDevice`): two devices on one GPU load their
    /// own copy, which costs one load each and keeps each module in its own context's terms.
    fn cache() -> &'static Mutex<Kernels> {
        static CACHE: OnceLock<Mutex<Kernels>> = OnceLock::new();
        CACHE.get_or_init(|| Mutex::new(KernelCache::new()))
    }

    /// Modules loaded so far in this process, over all devices and kernel files.
    pub fn module_loads() -> usize {
        cache().lock().map(|c| c.module_loads).unwrap_or(0)
    }

    /// The kernel `name` from `cubins` on `dev`: the cubin for the device's SM, loaded on first
    /// use (a refusal naming the fix when the build has none), then served from the cache.
    pub fn function(dev: &CudaDevice, cubins: &'static Cubins, name: &str) -> candle_core::Result<CudaFunction> {
        let mut cache = cache().lock().map_err(|_| err("kernel cache: poisoned lock".into()))?;
        cache.function(
            dev.id(),
            cubins.file,
            name,
            || {
                let built: Vec<u32> = cubins.archs.iter().map(|(a, _)| *a).collect();
                let arch = pick_arch(cubins.file, &built, sm_of(dev)?).map_err(err)?;
                let bytes = cubins.archs.iter().find(|(a, _)| *a == arch).map(|(_, b)| *b).unwrap_or_default();
                dev.cuda_stream()
                    .context()
                    .load_module(Ptx::from_binary(bytes.to_vec()))
                    .map_err(|e| err(format!("{} (sm_{arch} cubin) did not load on this GPU: {e:?}", cubins.file)))
            },
            |module, name| module.load_function(name).map_err(|e| err(format!("{}: no kernel {name}: {e:?}", cubins.file))),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::{pick_arch, KernelCache};

    /// A forward launches the same kernels again and again: after the first call each one is a
    /// lookup — no module load, no function lookup — and a second device loads its own copy.
    #[test]
    fn modules_and_functions_load_once_per_device() {
        let mut cache: KernelCache<u32, String, String> = KernelCache::new();
        let forward = |cache: &mut KernelCache<u32, String, String>, dev: u32| {
            for (file, name) in [("attn.cu", "fwd_bf16_d64"), ("ln.cu", "layer_norm_bf16"), ("ln.cu", "add_layer_norm_bf16")] {
                let f =
                    cache.function(dev, file, name, || Ok::<_, ()>(format!("{file} on {dev}")), |m, n| Ok(format!("{m}: {n}"))).unwrap();
                assert_eq!(f, format!("{file} on {dev}: {name}"));
            }
        };
        forward(&mut cache, 0);
        assert_eq!((cache.module_loads, cache.function_lookups), (2, 3));
        for _ in 0..3 {
            forward(&mut cache, 0);
        }
        assert_eq!((cache.module_loads, cache.function_lookups), (2, 3), "later forwards load nothing");
        forward(&mut cache, 1);
        assert_eq!((cache.module_loads, cache.function_lookups), (4, 6));
    }

    #[test]
    fn a_failed_load_is_not_cached() {
        let mut cache: KernelCache<u32, String, String> = KernelCache::new();
        assert!(cache.function(0, "k.cu", "f", || Err("no cubin"), |m, n| Ok(format!("{m}{n}"))).is_err());
        assert_eq!(cache.module_loads, 0);
        assert!(cache.function(0, "k.cu", "f", || Ok("m".to_string()), |_, _| Err("no kernel f")).is_err());
        assert_eq!((cache.module_loads, cache.function_lookups), (1, 0));
        assert_eq!(cache.function(0, "k.cu", "f", || Err("reloaded"), |m, n| Ok(format!("{m}:{n}"))), Ok("m:f".to_string()));
        assert_eq!((cache.module_loads, cache.function_lookups), (1, 1));
    }

    #[test]
    fn a_cubin_runs_on_its_major_at_the_same_or_a_later_minor() {
        assert_eq!(pick_arch("k.cu", &[80, 90], 90), Ok(90));
        assert_eq!(pick_arch("k.cu", &[80, 90], 86), Ok(80));
        assert_eq!(pick_arch("k.cu", &[80, 86, 90], 89), Ok(86));
        assert_eq!(pick_arch("k.cu", &[80], 89), Ok(80));
    }

    #[test]
    fn no_cubin_for_the_device_is_refused_with_the_fix() {
        let e = pick_arch("kernels/fp8.cu", &[90], 89).unwrap_err();
        assert!(e.contains("compiled for sm_90") && e.contains("SM 8.9"), "{e}");
        assert!(e.contains("CUDA_COMPUTE_CAP=89") && e.contains("CUDA_COMPUTE_CAP=90,89"), "{e}");
        assert!(pick_arch("k.cu", &[90], 100).is_err(), "no sm_90 machine code on Blackwell");
        assert!(pick_arch("k.cu", &[86], 80).is_err(), "a later minor's code does not run on an earlier one");
    }
}
