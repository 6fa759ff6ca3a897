//! With the `emulator` feature, compiles the CUDA kernels as plain C++ for the CPU emulation
//! (`cuda::emulate`): the same rust/kernels/hostkv_transfer.cu that scripts/gen_ptx.sh turns
//! into the embedded PTX, under rust/kernels/emu_shim.h. Needs only a C++ compiler, never nvcc;
//! without the feature it needs nothing.

fn main() {
    // Without this line a build script that prints no rerun-if-changed reruns on any change.
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "emulator")]
    compile_emulator();
}

#[cfg(feature = "emulator")]
fn compile_emulator() {
    let dir = "rust/kernels";
    for f in [
        "emu_runner.cpp",
        "emu_shim.h",
        "hostkv_transfer.cu",
        "hostkv_transfer.ptx",
    ] {
        println!("cargo:rerun-if-changed={dir}/{f}");
    }
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .include(dir)
        .file(format!("{dir}/emu_runner.cpp"))
        // The emulator runs every thread of a grid one after another: optimise even in debug
        // builds so the emulation tests stay quick.
        .opt_level(2)
        .warnings(true)
        .extra_warnings(true)
        .compile("hostkv_kernel_emu");
}
