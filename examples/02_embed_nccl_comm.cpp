// 02_embed_nccl_comm: graphep inside a serving stack that already owns its NCCL communicator, one
// process per GPU (run under mpirun). The stack creates ncclComm_t as usual; graphep adopts it
// (bootstrap and transport to peers without load/store access ride on it), builds its engine and
// runs dispatch -> the stack's expert (here the identity: y = x, one copy) -> combine. The stack's
// own NCCL calls keep working on the same communicator: here an allreduce of the error count.
//
//   mpirun -np 2 ./build/examples/02_embed_nccl_comm
//
// Exit code 0: out[t] = sum_k w[t][k] x[t] on every rank; 1: a mismatch; 77: fewer GPUs than ranks.
#include <cuda_bf16.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <graphep/graphep.hpp>

namespace {

#define CUDA_OK(call)                                                                          \
  do {                                                                                         \
    const cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                            \
    }                                                                                          \
  } while (0)

constexpr int kTokens = 64, kHidden = 512, kTopK = 4;

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int gpus = graphep::cudaDeviceCountOrZero();
  if (gpus < size) {  // NCCL puts one rank on each GPU
    if (rank == 0) std::printf("02_embed_nccl_comm: %d ranks need %d GPUs, %d present: nothing to run\n", size, size, gpus);
    MPI_Finalize();
    return 77;
  }
  CUDA_OK(cudaSetDevice(rank % gpus));

  // The stack's communicator, created the usual way.
  ncclUniqueId id;
  if (rank == 0) ncclGetUniqueId(&id);
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t nccl = nullptr;
  if (ncclCommInitRank(&nccl, size, id, rank) != ncclSuccess) {
    std::fprintf(stderr, "rank %d: ncclCommInitRank failed\n", rank);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  long long wrong = 0;
  try {
    auto comm = graphep::adoptNcclComms({nccl});
    graphep::MoeConfig cfg;
    cfg.maxTokensPerRank = kTokens;
    cfg.hidden = kHidden;
    cfg.numExperts = 8 * size;
    cfg.topK = kTopK;
    auto engine = graphep::Engine::create(*comm, cfg);

    // This rank's tokens and routing (top-k distinct experts, softmax-like positive weights).
    std::mt19937 rng(1234u + static_cast<unsigned>(rank));
    std::uniform_real_distribution<float> val(-1.f, 1.f), wd(0.1f, 1.f);
    std::vector<__nv_bfloat16> x(static_cast<std::size_t>(kTokens) * kHidden);
    for (auto& v : x) v = __float2bfloat16_rn(val(rng));
    std::vector<int> ids(static_cast<std::size_t>(kTokens) * kTopK);
    std::vector<float> w(ids.size());
    for (int t = 0; t < kTokens; ++t) {
      std::vector<int> pool(static_cast<std::size_t>(cfg.numExperts));
      for (int e = 0; e < cfg.numExperts; ++e) pool[static_cast<std::size_t>(e)] = e;
      std::shuffle(pool.begin(), pool.end(), rng);
      for (int k = 0; k < kTopK; ++k) {
        ids[static_cast<std::size_t>(t) * kTopK + k] = pool[static_cast<std::size_t>(k)];
        w[static_cast<std::size_t>(t) * kTopK + k] = wd(rng);
      }
    }
    void *dx = nullptr, *dids = nullptr, *dw = nullptr, *dn = nullptr, *dout = nullptr;
    CUDA_OK(cudaMalloc(&dx, x.size() * 2));
    CUDA_OK(cudaMalloc(&dids, ids.size() * 4));
    CUDA_OK(cudaMalloc(&dw, w.size() * 4));
    CUDA_OK(cudaMalloc(&dn, 4));
    CUDA_OK(cudaMalloc(&dout, x.size() * 2));
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // The inputs on the stream the engine runs on (a non-blocking stream is not ordered after
    // the legacy stream a plain cudaMemcpy uses).
    CUDA_OK(cudaMemcpyAsync(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(dids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(dn, &kTokens, 4, cudaMemcpyHostToDevice, stream));

    graphep::DispatchArgs da;
    da.x = dx;
    da.topkIdx = dids;
    da.topkWeights = static_cast<const float*>(dw);
    da.numTokens = static_cast<const int*>(dn);
    const graphep::DispatchLayout& v = engine->dispatch(da, stream);
    // The stack's expert: the identity, straight into the engine's expert-output buffer.
    CUDA_OK(cudaMemcpyAsync(v.expertOutput, v.recvX, static_cast<std::size_t>(v.capacity) * kHidden * 2,
                            cudaMemcpyDeviceToDevice, stream));
    graphep::CombineArgs ca;
    ca.out = dout;
    engine->combine(ca, stream);
    CUDA_OK(cudaStreamSynchronize(stream));

    std::vector<__nv_bfloat16> out(x.size());
    CUDA_OK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
    for (int t = 0; t < kTokens; ++t) {
      double wsum = 0;
      for (int k = 0; k < kTopK; ++k) wsum += w[static_cast<std::size_t>(t) * kTopK + k];
      for (int h = 0; h < kHidden; ++h) {
        const double ref = wsum * static_cast<double>(__bfloat162float(x[static_cast<std::size_t>(t) * kHidden + h]));
        const double got = static_cast<double>(__bfloat162float(out[static_cast<std::size_t>(t) * kHidden + h]));
        if (!(std::fabs(got - ref) <= std::fabs(ref) / 128.0 + 1e-6)) ++wrong;
      }
    }
    const graphep::MoeStatus st = engine->status();
    if (!st.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, st.describe().c_str());
      ++wrong;
    }
    // The stack's own collective on the communicator graphep also uses.
    long long* dwrong = nullptr;
    CUDA_OK(cudaMalloc(&dwrong, sizeof(long long)));
    CUDA_OK(cudaMemcpyAsync(dwrong, &wrong, sizeof(long long), cudaMemcpyHostToDevice, stream));
    if (ncclAllReduce(dwrong, dwrong, 1, ncclInt64, ncclSum, nccl, stream) != ncclSuccess) {
      std::fprintf(stderr, "rank %d: ncclAllReduce failed\n", rank);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(&wrong, dwrong, sizeof(long long), cudaMemcpyDeviceToHost));
    if (rank == 0) {
      std::printf("02_embed_nccl_comm: %d processes, engine on the adopted ncclComm_t (%s path), %lld wrong values "
                  "over all ranks: %s\n",
                  size, graphep::name(engine->path()), wrong,
                  wrong == 0 ? "PASS" : "FAIL");
    }
    for (void* p : {dx, dids, dw, dn, dout, static_cast<void*>(dwrong)}) cudaFree(p);
    cudaStreamDestroy(stream);
    engine.reset();
  } catch (const graphep::Error& e) {
    std::fprintf(stderr, "rank %d: %s: %s\n", rank, graphep::statusName(e.status()), e.what());
    wrong = 1;
  }
  ncclCommDestroy(nccl);  // the stack's communicator, destroyed by the stack after graphep
  MPI_Finalize();
  return wrong == 0 ? 0 : 1;
}
