//! Loading the kernels `build.rs` compiled (`kernel_build.rs`): each kernel file comes as one
//! cubin (machine code) per architecture in CUDA_COMPUTE_CAP at build time. At run time the op
//! picks the cubin for the device's SM, or refuses with the fix when the build has none, and
//! loads it once per device: later launches find the function in a cache and do no module work.
//! Stages 3 and 4 load their kernels through this module too.

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
pub use load::{check, function};

#[cfg(feature = "cuda")]
mod load {
    use super::{pick_arch, Cubins};
    use candle_core::cuda::cudarc::driver::{CudaFunction, CudaModule};
    use candle_core::cuda::cudarc::nvrtc::Ptx;
    use candle_core::cuda::{CudaDevice, DeviceId};
    use std::collections::HashMap;
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

    type Modules = HashMap<(DeviceId, &'static str), Arc<CudaModule>>;
    type Functions = HashMap<(DeviceId, &'static str), HashMap<String, CudaFunction>>;

    /// Loaded modules per (device, kernel file) and functions per (device, file, function).
    /// Keyed by candle's `DeviceId` (one per `CudaDevice`): two devices on one GPU load their
    /// own copy, which costs one load each and keeps each module in its own context's terms.
    fn caches() -> &'static Mutex<(Modules, Functions)> {
        static CACHE: OnceLock<Mutex<(Modules, Functions)>> = OnceLock::new();
        CACHE.get_or_init(|| Mutex::new((HashMap::new(), HashMap::new())))
    }

    /// The kernel `name` from `cubins` on `dev`: the cubin for the device's SM, loaded on first
    /// use (a refusal naming the fix when the build has none), then served from the cache.
    pub fn function(dev: &CudaDevice, cubins: &'static Cubins, name: &str) -> candle_core::Result<CudaFunction> {
        let mut guard = caches().lock().map_err(|_| err("kernel cache: poisoned lock".into()))?;
        let (modules, functions) = &mut *guard;
        if let Some(f) = functions.get(&(dev.id(), cubins.file)).and_then(|fs| fs.get(name)) {
            return Ok(f.clone());
        }
        let module = match modules.get(&(dev.id(), cubins.file)) {
            Some(m) => m.clone(),
            None => {
                let built: Vec<u32> = cubins.archs.iter().map(|(a, _)| *a).collect();
                let arch = pick_arch(cubins.file, &built, sm_of(dev)?).map_err(err)?;
                let bytes = cubins.archs.iter().find(|(a, _)| *a == arch).map(|(_, b)| *b).unwrap_or_default();
                let m = dev
                    .cuda_stream()
                    .context()
                    .load_module(Ptx::from_binary(bytes.to_vec()))
                    .map_err(|e| err(format!("{} (sm_{arch} cubin) did not load on this GPU: {e:?}", cubins.file)))?;
                modules.insert((dev.id(), cubins.file), m.clone());
                m
            }
        };
        let f = module.load_function(name).map_err(|e| err(format!("{}: no kernel {name}: {e:?}", cubins.file)))?;
        functions.entry((dev.id(), cubins.file)).or_default().insert(name.to_string(), f.clone());
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::pick_arch;

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
