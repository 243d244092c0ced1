// Empty on purpose: mma.h in this folder emulates what flash_attn.cu takes from CUDA's headers.
#pragma once
