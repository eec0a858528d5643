//! `flashsample!` rejects invalid pipelines at compile time, pointing at the offending tokens.

#[test]
fn invalid_pipelines_fail_to_compile() {
    trybuild::TestCases::new().compile_fail("trybuild/*.rs");
}
