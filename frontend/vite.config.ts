import { defineConfig } from "vite";

// The control plane serves the bundle at /dashboard/ (platform/controlplane/dashboard).
export default defineConfig({
  base: "/dashboard/",
  build: { outDir: "dist", emptyOutDir: true, chunkSizeWarningLimit: 600 },
});
