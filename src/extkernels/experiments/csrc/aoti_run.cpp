// Runs an AOTInductor package from C++, without Python: loads the operator libraries
// the package calls (dlopen, so that their TORCH_LIBRARY blocks register the
// operators), then the package, runs it on the inputs saved beside the expected output
// and prints, as one JSON line, the seconds of the load and the first call, the
// largest difference from the expected output and the milliseconds per later call;
// where the load or the first call fails, the error's first line on stderr.
//
// usage: aoti_run package.pt2 data.pt [library.so ...]
// data.pt: torch.save((p_query, p_ref, expected, device)), the tensors on the CPU and
// the device ("cpu", "cuda") as a string; on a GPU the first library is PyTorch's own
// libtorch_cuda.so, which registers the CUDA kernels with the dispatcher
#include <dlfcn.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: aoti_run package.pt2 data.pt [operator_library.so ...]\n";
    return 2;
  }
  for (int i = 3; i < argc; ++i) {
    if (!dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL)) {
      std::cerr << dlerror() << "\n";
      return 1;
    }
  }
  std::ifstream file(argv[2], std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), {});
  auto data = torch::pickle_load(bytes).toTuple()->elements();
  const c10::Device device(data[3].toStringRef());
  const at::Tensor q = data[0].toTensor().to(device), r = data[1].toTensor().to(device);
  const at::Tensor expected = data[2].toTensor().to(device);
  c10::InferenceMode inference;
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  std::vector<at::Tensor> out;
  try {
    loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(argv[1]);
    out = loader->run({q, r});
    if (out[0].is_cuda()) out[0].cpu();  // waits for the device
  } catch (const c10::Error& e) {  // the message's first line, without the backtrace
    const std::string what = e.what_without_backtrace();
    std::cerr << what.substr(0, what.find('\n')) << "\n";
    return 1;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    std::cerr << what.substr(0, what.find('\n')) << "\n";
    return 1;
  }
  const auto t1 = clock::now();
  const double diff = (out[0] - expected).abs().max().item<double>();
  const int n = 50;
  const auto t2 = clock::now();
  for (int i = 0; i < n; ++i) out = loader->run({q, r});
  if (out[0].is_cuda()) out[0].cpu();  // waits for the device
  const auto t3 = clock::now();
  std::cout << "{\"first_call_s\": " << std::chrono::duration<double>(t1 - t0).count()
            << ", \"max_abs_diff\": " << diff << ", \"ms\": "
            << std::chrono::duration<double, std::milli>(t3 - t2).count() / n << "}\n";
  return 0;
}
