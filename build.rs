//! Link flags for the `pgleader` binary, for its resident memory.
//!
//! pgleader is a position-independent executable (address-space randomisation; the release's
//! static binary is a static-pie), so at every start, pgleader's and every keeper's, it
//! relocates its own pointers. Stored the classic way (RELA, 24 bytes a pointer) that table is
//! about 200 kB that each process reads in full before `main`. `-z pack-relative-relocs`
//! (DT_RELR) stores the same relocations as a bitmap of a few kB. glibc 2.36 and later read it,
//! in a dynamic binary and in a static-pie; a dynamic build then needs glibc 2.36 at run time
//! too (the release's static binary needs nothing).
//!
//! `keeper.ld` gathers the keeper's code ahead of `.text` (see the script for why): a linker
//! script that only INSERTs a section, so the linker keeps its own layout for the rest.

fn main() {
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    if os == "linux" && env == "gnu" {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
    // Only if it is there: a build script that cargo reuses in another checkout sharing the
    // target directory (cargo keys it by the package, not by its path) must not make that
    // checkout's link fail.
    let script = std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default())
        .join("keeper.ld");
    if os == "linux" && script.exists() {
        println!("cargo:rustc-link-arg-bins=-Wl,-T,{}", script.display());
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=keeper.ld");
}
