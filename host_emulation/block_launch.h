// The launcher the ln_host.h checks share (ln_check, ln_fp8_check, fp8_check): the definitions
// ln_host.h declares, and `launch`, which runs a kernel block by block, one std::thread per CUDA
// thread. Include it after the kernel source.
#pragma once
#include <algorithm>
#include <barrier>
#include <memory>
#include <thread>
#include <vector>

thread_local dim3 threadIdx;
dim3 blockIdx;
std::barrier<>* block_barrier;
std::barrier<>* warp_barrier[32];
float shfl_buf[32][32];

// Run `kernel()` on `blocks` blocks of `threads` threads (at most 1024), one block at a time.
template <typename F>
void launch(long blocks, int threads, F kernel) {
    for (long blk = 0; blk < blocks; ++blk) {
        blockIdx = {(unsigned)blk, 0, 0};
        std::barrier<> block(threads);
        std::unique_ptr<std::barrier<>> warps[32];
        for (int w = 0; w < (threads + 31) / 32; ++w)
            warp_barrier[w] = (warps[w] = std::make_unique<std::barrier<>>(std::min(32, threads))).get();
        block_barrier = &block;
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t)
            ts.emplace_back([&, t] {
                threadIdx = {(unsigned)t, 0, 0};
                kernel();
            });
        for (auto& th : ts) th.join();
    }
}
