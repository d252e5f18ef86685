// Replays recordings of kvcal_decode_attention_cpu (tests/helpers/cpu_replay.py) against this build of the kernel,
// unchanged: the recorded regions are loaded, the descriptor's addresses relocated into them, the calls made in
// order, and the output compared with the recording's within |got - want| <= ATOL + RTOL |want|. Prints one line per
// file; exits 1 if any differs.
#include "decode_attention_cpu.cpp"

#include <cstdio>
#include <fstream>
#include <iterator>

namespace replay {

constexpr float ATOL = 2e-5f, RTOL = 2e-5f;  // two float32 summation orders, each within 1e-5 of the torch reference

struct Reader {
    std::vector<char> bytes;
    size_t at = 0;
    template <class T>
    T get() {
        T value;
        std::memcpy(&value, bytes.data() + at, sizeof(T));
        at += sizeof(T);
        return value;
    }
};

struct Argument {
    uint8_t kind;
    uint64_t bits;  // the pointer, int or float's bits
};

bool replay_file(const char* path) {
    std::ifstream file(path, std::ios::binary);
    Reader in{std::vector<char>(std::istreambuf_iterator<char>(file), {})};
    if (in.bytes.size() < 4 || std::memcmp(in.bytes.data(), "KVRP", 4) != 0) {
        std::printf("%s: not a recording\n", path);
        return false;
    }
    in.at = 4;
    std::vector<std::vector<char>> regions(in.get<uint32_t>());
    for (auto& region : regions) {
        region.resize(in.get<uint64_t>());
        std::memcpy(region.data(), in.bytes.data() + in.at, region.size());
        in.at += region.size();
    }
    auto address = [&](uint32_t region, uint64_t offset) { return (uint64_t)(uintptr_t)(regions[region].data() + offset); };
    std::vector<std::vector<Argument>> calls(in.get<uint32_t>());
    for (auto& call : calls) {
        call.resize(in.get<uint32_t>());
        for (auto& argument : call) {
            argument.kind = in.get<uint8_t>();
            if (argument.kind == 0) {
                const uint32_t region = in.get<uint32_t>();
                argument.bits = address(region, in.get<uint64_t>());
            } else if (argument.kind == 1 || argument.kind == 3) {
                argument.bits = in.get<uint32_t>();
            } else if (argument.kind == 2) {
                argument.bits = in.get<uint64_t>();
            } else {
                argument.bits = 0;
            }
        }
    }
    const uint32_t relocations = in.get<uint32_t>();
    for (uint32_t r = 0; r < relocations; ++r) {
        const uint32_t region = in.get<uint32_t>();
        const uint64_t offset = in.get<uint64_t>();
        const uint32_t target = in.get<uint32_t>();
        const uint64_t pointer = address(target, in.get<uint64_t>());
        std::memcpy(regions[region].data() + offset, &pointer, 8);
    }
    const uint32_t out_region = in.get<uint32_t>();
    const uint64_t out_offset = in.get<uint64_t>(), count = in.get<uint64_t>();
    const float* want = (const float*)(in.bytes.data() + in.at);
    for (const auto& a : calls) {
        auto p = [&](int i) { return (const void*)(uintptr_t)a[i].bits; };
        auto i32 = [&](int i) { return (int)(int32_t)(uint32_t)a[i].bits; };
        auto f32 = [&](int i) {
            float value;
            const uint32_t bits = (uint32_t)a[i].bits;
            std::memcpy(&value, &bits, 4);
            return value;
        };
        kvcal_decode_attention_cpu((const float*)p(0), (const long long*)p(1), (const int32_t*)p(2), (const float*)p(3),
                                   (const float*)p(4), (long long)a[5].bits, i32(6), i32(7), i32(8), i32(9), i32(10), i32(11),
                                   f32(12), f32(13), (float*)p(14), (float*)p(15), (float*)p(16), (const int32_t*)p(17),
                                   i32(18), i32(19), i32(20));
    }
    const float* got = (const float*)(regions[out_region].data() + out_offset);
    float worst = 0.0f;
    bool ok = true;
    for (uint64_t i = 0; i < count; ++i) {
        float want_i;
        std::memcpy(&want_i, want + i, 4);
        const float error = std::fabs(got[i] - want_i);
        worst = std::fmax(worst, error);
        ok = ok && error <= ATOL + RTOL * std::fabs(want_i);
    }
    std::printf("%s: %s, %d lanes, largest difference %.3g over %llu values\n", path, ok ? "ok" : "DIFFERS", kvcal_cpu_lanes(),
                worst, (unsigned long long)count);
    return ok;
}

}  // namespace replay

int main(int argc, char** argv) {
    bool ok = true;
    for (int i = 1; i < argc; ++i) ok = replay::replay_file(argv[i]) && ok;
    return ok ? 0 : 1;
}
