// Rebuild when a migration is added: `sqlx::migrate!` embeds the directory at compile
// time, and on stable Rust cargo does not know it depends on files added there.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
