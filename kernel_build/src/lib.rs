//! The hand-written CUDA kernels' build, once for every stage that has some (stages 2, 3 and 4):
//! a build-dependency whose `build::build_cubins` a stage's `build.rs` calls. With the stage's
//! `cuda` feature, nvcc compiles each `kernels/*.cu` file to one cubin per architecture in
//! CUDA_COMPUTE_CAP and writes the table the stage includes; CPU builds do nothing and need no
//! nvcc. Loading them at run time is `kernel_cache`'s.

pub mod build;
