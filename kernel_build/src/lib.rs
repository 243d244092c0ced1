//! The hand-written CUDA kernels' build and loading, once for every stage that has some
//! (stages 2, 3 and 4):
//!
//! - `build`: called from a stage's `build.rs` (a build-dependency): with the stage's `cuda`
//!   feature, nvcc compiles each `kernels/*.cu` file to one cubin per architecture in
//!   CUDA_COMPUTE_CAP and writes the table the stage includes. CPU builds do nothing and need
//!   no nvcc.
//! - `cubin`: at run time, the cubin for the device's SM is picked (or refused with the fix) and
//!   loaded once per device; later launches are a cache lookup. Loading needs the `cuda` feature.

pub mod build;
pub mod cubin;
