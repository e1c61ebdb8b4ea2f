/*
 * heatmap.c -- attention maps as shaded text (heatmap.h).
 */
#include "heatmap.h"

void tool_heatmaps(FILE *f, const float *const *maps, const char *const *titles,
                   int n, int rows, int cols, const char *row_labels,
                   const char *col_labels)
{
    static const char *shade[] = {" ", "░", "▒", "▓", "█"};
    const int width = 2 * cols + 5;   /* "x [ " + cells + "]", then 4 blanks */
    for (int m = 0; m < n; m++)
        fprintf(f, "%-*.*s    ", width, width, titles[m]);
    fputc('\n', f);
    if (col_labels) {
        for (int m = 0; m < n; m++) {
            fputs("    ", f);
            for (int j = 0; j < cols; j++)
                fprintf(f, "%c ", col_labels[j]);
            fputs("     ", f);
        }
        fputc('\n', f);
    }
    for (int i = 0; i < rows; i++) {
        for (int m = 0; m < n; m++) {
            float mx = 0.0f;
            for (int k = 0; k < rows * cols; k++)
                if (maps[m][k] > mx)
                    mx = maps[m][k];
            fprintf(f, "%c [ ", row_labels ? row_labels[i] : ' ');
            for (int j = 0; j < cols; j++) {
                float w = maps[m][i * cols + j];
                /* Five levels of w / max: ' ' below 1/10, then quarters. */
                int lvl = mx <= 0.0f || w < 0.1f * mx ? 0
                        : w < 0.25f * mx ? 1
                        : w < 0.5f * mx ? 2
                        : w < 0.75f * mx ? 3 : 4;
                fprintf(f, "%s ", shade[lvl]);
            }
            fputs("]    ", f);
        }
        fputc('\n', f);
    }
}
