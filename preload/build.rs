//! Compiles the variadic exec hooks (`src/hooks/execl.c`): stable Rust cannot define a C
//! variadic function.
fn main() {
    println!("cargo:rerun-if-changed=src/hooks/execl.c");
    cc::Build::new()
        .file("src/hooks/execl.c")
        .warnings(true)
        .extra_warnings(true)
        .compile("smcr_execl");
}
